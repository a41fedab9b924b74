"""Cross-domain recipe choice, final training and label-free adaptation (see run.py)."""
