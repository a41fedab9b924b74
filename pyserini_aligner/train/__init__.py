"""Training AligneR checkpoints: ``python -m pyserini_aligner.train --config <yaml>``."""
