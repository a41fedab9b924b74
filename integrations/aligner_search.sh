#!/usr/bin/env bash
# The plugin's own CLI: Pyserini's flags plus alignment and pruning knobs.
set -euo pipefail
: "${INDEX:?}" "${TOPICS:?}" "${OUT:?}"
"${PYTHON:-python}" -m pyserini_aligner.search --index "$INDEX" --topics "$TOPICS" \
  --output "$OUT/run.aligner-top2.trec" --hits 1000 --remove-query --batch-size 16 --threads 2 \
  --strategy top-k:2 --query-prune 0.5 --k-per-token 64 --quiet
