"""AligneR sweeps on one dataset: ``python -m eval.sweeps --dataset beir/scifact/test --output runs/sweeps``."""
