"""Glue between pyserini-aligner and Pyserini's own modules and command lines."""
