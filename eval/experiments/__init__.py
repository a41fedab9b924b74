"""One-off studies behind the numbers in the README (not part of ``make run``); their outputs are in ``results/``."""
