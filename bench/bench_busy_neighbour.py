"""The native m=1 draft step next to busy neighbours: fixed thread teams against the adaptive one.

    python -m bench.bench_busy_neighbour [--reps 200] [--shape smollm2|llama8b]

SmolLM2-135M draft shapes by default (d=576, 9 heads / 3 KV heads, intermediate 1536, draft
vocabulary 8192, m=1, context 300). Three conditions, each measured after its neighbours started:
no added load, one busy process (`while True: pass`), two busy processes. In each, the step of a
`NativeDraftDecoder` with a fixed team of 1 and of 2 threads and with the adaptive team
(threads=None: `threads.FreeCores`), interleaved in rounds of 20 steps, medians. The adaptive
step must stay within 1.3x of the best fixed team's time at that moment.
Rows: bench/results/busy_neighbour_cpu.jsonl.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from bench.common import device_name, record
from elsi_fast.draft import Eagle3Config, Eagle3Draft
from elsi_fast.draft.native import NativeDraftDecoder

SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                    vocab_size=49152, draft_vocab_size=8192),
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                    vocab_size=128256, draft_vocab_size=32000),
}
CONTEXT = 300
TEAMS = (1, 2, None)


def decoder_steps(shape: str, weight_dtype: str, threads: int | None):
    torch.manual_seed(0)
    config = Eagle3Config(**SHAPES[shape], aux_layer_ids=(18,))
    draft = Eagle3Draft(config, torch.randn(config.vocab_size, config.hidden_size) * 0.02).eval()
    decoder = NativeDraftDecoder(draft, weight_dtype, max_len=CONTEXT + 2, threads=threads)
    decoder._k_cache.normal_()
    decoder._v_cache.normal_()
    aux = torch.randn(config.fc_in_features)

    def step():
        decoder.length = CONTEXT
        decoder.step(aux, 7, from_target=True)

    return step


def measure(steps: dict, reps: int) -> dict:
    times = {key: [] for key in steps}
    for fn in steps.values():
        fn()
    for _ in range(max(1, reps // 20)):
        for key, fn in steps.items():
            for _ in range(20):
                start = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - start)
    return {key: statistics.median(values) for key, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "int8"])
    args = parser.parse_args()
    torch.set_num_threads(2)
    device = device_name("cpu", threads=2)
    for busy in (0, 1, 2):
        neighbours = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            time.sleep(2.0)  # the neighbours are running; FreeCores' first sample interval passes
            for weight_dtype in args.dtypes:
                steps = {("adaptive" if t is None else f"{t} threads"): decoder_steps(args.shape, weight_dtype, t)
                         for t in TEAMS}
                seconds = measure(steps, args.reps)
                best = min(seconds["1 threads"], seconds["2 threads"])
                ratio = seconds["adaptive"] / best
                record("busy_neighbour_cpu", "native_step_busy_neighbour", f"adaptive_over_best/{weight_dtype}", ratio,
                       "x", device=device, baseline=best, params={
                           "shape": args.shape, "context": CONTEXT, "busy_processes": busy, "weight_dtype": weight_dtype,
                           "ms": {k: 1e3 * v for k, v in seconds.items()}, "reps": args.reps, "loadavg": os.getloadavg(),
                           "target": "adaptive <= 1.3x the best fixed team"})
                print(f"busy {busy} {weight_dtype}: " + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in seconds.items())
                      + f" -> adaptive / best {ratio:.2f}x", flush=True)
        finally:
            for process in neighbours:
                process.kill()


if __name__ == "__main__":
    main()
