"""Speed and size benchmark: ``python -m eval.bench --dataset beir/scifact/test --output <dir>``."""
