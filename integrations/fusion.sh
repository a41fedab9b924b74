#!/usr/bin/env bash
# Fuse AligneR and BM25 runs: Pyserini's fusion CLI (RRF) and ranx's fuse.
set -euo pipefail
: "${OUT:?}"
BM25_RUN="${BM25_RUN:-$OUT/run.bm25.trec}"
"${PYTHON:-python}" -m pyserini.fusion --runs "$OUT/run.aligner.trec" "$BM25_RUN" \
  --output "$OUT/run.pyserini-rrf.trec" --method rrf --k 1000
"${PYTHON:-python}" - "$OUT/run.aligner.trec" "$BM25_RUN" "$OUT/run.ranx-rrf.trec" <<'PY'
import sys
from ranx import Run, fuse

aligner, bm25 = Run.from_file(sys.argv[1], kind="trec"), Run.from_file(sys.argv[2], kind="trec")
fuse(runs=[aligner, bm25], method="rrf").save(sys.argv[3], kind="trec")
PY
