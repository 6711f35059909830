#!/usr/bin/env bash
# Regenerates the figures in docs/img/: the two real models' (bench/real_models.py analyze stage,
# which copies its plots there as smollm2_*.png and gemma3_*.png; cells already computed under
# runs/real-models/ are reused, so delete a model's folder there to rerun it) and the toy worked
# example's stories260K_*.png. From the repository root, with the environment of the README's
# set-up: bash docs/regenerate_figures.sh
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m bench.real_models --stages analyze
.venv/bin/elsi-fast analyze --model ../shared/data/models/stories260K/stories260K.bin \
    --prompts ../shared/data/prompts/spec_bench_question.jsonl --out runs/stories260K --m 1 2 3
for plot in entropy cka pair_gain; do
    cp "runs/stories260K/$plot.png" "docs/img/stories260K_$plot.png"
done
