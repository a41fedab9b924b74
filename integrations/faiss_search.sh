#!/usr/bin/env bash
# Pyserini's dense-search CLI on an AligneR index, unchanged.
set -euo pipefail
: "${INDEX:?}" "${TOPICS:?}" "${OUT:?}"
"${PYTHON:-python}" -m pyserini.search.faiss --index "$INDEX" --encoder aligner --topics "$TOPICS" \
  --output "$OUT/run.aligner.trec" --hits 1000 --remove-query
