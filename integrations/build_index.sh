#!/usr/bin/env bash
# Build an AligneR index of a JsonCollection (or an ir_datasets id such as beir/scifact).
set -euo pipefail
: "${CORPUS:?set CORPUS to a JsonCollection file/folder or an ir_datasets id}" "${INDEX:?set INDEX}"
"${PYTHON:-python}" -m pyserini_aligner.index --corpus "$CORPUS" --index "$INDEX" --encoder aligner \
  --batch-size 32 --quiet
