#!/usr/bin/env bash
# Pyserini's hybrid CLI: AligneR (dense side) + BM25 (sparse side), linear fusion with alpha.
set -euo pipefail
: "${INDEX:?}" "${LUCENE_INDEX:?}" "${TOPICS:?}" "${OUT:?}"
"${PYTHON:-python}" -m pyserini.search.hybrid \
  dense --index "$INDEX" --encoder aligner \
  sparse --index "$LUCENE_INDEX" \
  fusion --alpha 0.1 \
  run --topics "$TOPICS" --output "$OUT/run.hybrid.trec"
