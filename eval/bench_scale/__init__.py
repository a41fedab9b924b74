"""Scale benchmark: ``python -m eval.bench_scale --beir-zip scifact.zip --sizes 5k,100k,1m --output <dir>``.

Builds AligneR indexes over a synthetic MS MARCO-like corpus grown from SciFact (:mod:`.corpus`) at several sizes
and reports build time, memory, disk, latency, throughput, agreement with exhaustive scoring and SciFact nDCG@10 at
each size (:mod:`.run`, :mod:`.report`). Needs torch and transformers only (no Pyserini, FAISS, ir_datasets or ranx).
"""
