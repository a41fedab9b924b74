"""One-off studies behind the numbers in docs/results.md (not part of ``make run``); their outputs are in ``results/``."""
