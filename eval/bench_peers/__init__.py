"""Side by side with FastPlaid: ``python -m eval.bench_peers --beir-zip scifact.zip --size 1m --output <dir>``.

Builds FastPlaid (lightonai/fast-plaid, a Rust/CUDA PLAID engine) and this project's default index over the same
token vectors of a synthetic corpus (:mod:`eval.bench_scale.corpus`), searches both on the same GPU in the same run,
and reports build time, bytes on disk, latency, throughput, GPU memory, overlap@10 with exhaustive scoring of the
exact tokens and nDCG@10, with the ratios (:mod:`.run`, :mod:`.report`). GPU only; FastPlaid is not a dependency
of this project: install the fast-plaid release built for the installed torch to run it.
"""
