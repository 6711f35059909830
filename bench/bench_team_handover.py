"""A speculative round's two native halves back to back: the GGUF target forward, then the draft step.

    python -m bench.bench_team_handover [--steps 150] [--rounds 3] [--no-record]

SmolLM2's Q4_1 package file on `NativeForward` (2 threads) forwards one token, then the kept m=1
draft (bf16, `NativeDraftDecoder` with a fixed team of 1 or 2 threads) takes one step from target
features; --steps such pairs per contender, the first 20 dropped, medians, contenders interleaved
over --rounds. When the two halves ran on two thread teams (the draft step's OpenMP team, the
target's pool), a 2-thread draft made the pair slower than a 1-thread one: each team spun or slept
while the other worked (docs/native-target.md). Both now run on one pool (csrc/common/cpu_pool.h).
Rows: bench/results/team_handover_cpu.jsonl, metric pair_ms/draft_threads=<t> (baseline: the pair
with a 1-thread draft step), with the forward's and the step's own medians in params.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.bench_native_target import DRAFT, gguf_files, target_embedding
from bench.common import device_name, record
from elsi_fast.draft import read_draft
from elsi_fast.draft.native import NativeDraftDecoder
from elsi_fast.targets.native_forward import NativeForward

TARGET_THREADS = 2
WARMUP = 20


def pairs(model: NativeForward, decoder: NativeDraftDecoder, fc_in: int, steps: int) -> dict[str, float]:
    """Median ms of the target forward, the draft step and the pair over `steps` pairs."""
    model.rollback(0)
    features = torch.randn(fc_in, generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {"forward_ms": [], "step_ms": [], "pair_ms": []}
    for i in range(steps):
        t0 = time.perf_counter()
        model.forward([1 + i % 100])
        t1 = time.perf_counter()
        decoder.step(features, 5 + i, True, 1)
        t2 = time.perf_counter()
        for key, seconds in (("forward_ms", t1 - t0), ("step_ms", t2 - t1), ("pair_ms", t2 - t0)):
            times[key].append(1e3 * seconds)
    return {key: statistics.median(values[WARMUP:]) for key, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-record", action="store_true", help="print only (a smoke run)")
    args = parser.parse_args(argv)
    if args.steps <= WARMUP:
        parser.error(f"--steps: must be more than {WARMUP} (the dropped warm-up pairs), got {args.steps}")

    torch.set_num_threads(TARGET_THREADS)
    model = NativeForward(gguf_files(["Q4_1"])["Q4_1"], capacity=args.steps + 8, num_threads=TARGET_THREADS)
    draft = read_draft(DRAFT, embed_tokens=target_embedding(model))
    load_before = os.getloadavg()
    samples: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    for r in range(args.rounds):
        for t in samples:
            # A new decoder per contender, as each speculative generate call makes one.
            decoder = NativeDraftDecoder(draft, "bf16", max_len=args.steps + 8, threads=t)
            samples[t].append(pairs(model, decoder, draft.config.fc_in_features, args.steps))
            print(f"round {r + 1} draft threads={t}: " + ", ".join(f"{k} {v:.2f}" for k, v in samples[t][-1].items()),
                  flush=True)
    medians = {t: {k: statistics.median(s[k] for s in rows) for k in rows[0]} for t, rows in samples.items()}
    for t, m in medians.items():
        print(f"draft threads={t}: pair {m['pair_ms']:.2f} ms (forward {m['forward_ms']:.2f}, step {m['step_ms']:.3f})")
    if not args.no_record:
        params = {"target": "smollm2 Q4_1", "target_threads": TARGET_THREADS, "draft": str(DRAFT.name),
                  "draft_dtype": "bf16", "steps": args.steps, "rounds": args.rounds,
                  "loadavg": [load_before, os.getloadavg()]}
        for t, m in medians.items():
            record("team_handover_cpu", "team_handover", f"pair_ms/draft_threads={t}", m["pair_ms"], "ms",
                   device=device_name("cpu", TARGET_THREADS), baseline=medians[1]["pair_ms"],
                   ratio=m["pair_ms"] / medians[1]["pair_ms"],
                   params={**params, "samples": samples[t], "forward_ms": m["forward_ms"], "step_ms": m["step_ms"]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
