#!/usr/bin/env bash
# The command users type out of habit: Pyserini forwards it to pyserini.search.lucene, which hands an
# AligneR index to AligneR (with the encoder recorded in the index manifest).
set -euo pipefail
: "${INDEX:?}" "${TOPICS:?}" "${OUT:?}"
"${PYTHON:-python}" -m pyserini.search --index "$INDEX" --topics "$TOPICS" --encoder aligner \
  --output "$OUT/run.habit.trec"
