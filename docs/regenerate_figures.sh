#!/usr/bin/env bash
# Regenerates docs/img/stories260K_*.png: runs the README's worked example, copies its plots.
# From the repository root, with the environment of the README's set-up: bash docs/regenerate_figures.sh
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/elsi-fast analyze --model ../shared/data/models/stories260K/stories260K.bin \
    --prompts ../shared/data/prompts/spec_bench_question.jsonl --out runs/stories260K --m 1 2 3
for plot in entropy cka pair_gain; do
    cp "runs/stories260K/$plot.png" "docs/img/stories260K_$plot.png"
done
