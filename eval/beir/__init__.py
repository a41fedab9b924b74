"""BEIR evaluation harness: ``python -m eval.beir --dataset beir/scifact/test --systems bm25 --output runs/scifact``."""
