"""Time the metric library against plain torch, side by side, and append the ratios to
bench/results/metrics_<cpu|cuda>.jsonl (ratio = baseline / ours: > 1 means elsi-fast is faster or
uses less memory).

    .venv/bin/python bench/run_metrics.py              # CPU (float64), torch's default threads
    .venv/bin/python bench/run_metrics.py --threads 1  # on a shared, oversubscribed CPU
    BENCH_DEVICE=cuda python bench/run_metrics.py      # GPU (float32 accumulation, Triton kernels)

On a CPU shared with other busy processes, use --threads 1: every multi-threaded (OpenMP) op
then waits for its sibling thread to be scheduled, which adds milliseconds per op and measures
the scheduler rather than the code.

Peak memory of token entropy: on CUDA torch.cuda.max_memory_allocated; on CPU the growth of the
process's peak resident set (VmHWM in /proc/self/status, reset through /proc/self/clear_refs after
the input exists), each measured in a fresh subprocess so freed-but-cached heap from an earlier
measurement cannot hide an allocation.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_metrics import (  # noqa: E402
    CKA_SHAPE,
    COV_CHUNK,
    COV_SHAPE,
    DEVICE,
    ENTROPY_SHAPE,
    categorical_entropy,
    cka_inputs,
    cka_matrix_per_pair,
    covariance_inputs,
    covariance_streaming,
    covariance_torch_cov,
    entropy_inputs,
)
from bench.common import device_name, record, time_fn  # noqa: E402
from elsi_fast import cka_matrix, token_entropy  # noqa: E402

RESULTS = f"metrics_{DEVICE.type}"
ENTROPY_FNS = {"token_entropy": token_entropy, "categorical": categorical_entropy}


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def peak_bytes_in_this_process(name: str) -> int:
    """Peak extra memory of one call of ENTROPY_FNS[name] on a fresh entropy input."""
    logits = entropy_inputs()
    fn = ENTROPY_FNS[name]
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn(logits)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    base = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    fn(logits)
    return (_status_kib("VmHWM") - base) * 1024


def peak_bytes(name: str) -> int:
    out = subprocess.run([sys.executable, __file__, "--peak", name], check=True, capture_output=True, text=True,
                         env={**os.environ, "BENCH_DEVICE": DEVICE.type})
    return int(out.stdout.strip().splitlines()[-1])


def compare(benchmark: str, ours, baseline, params: dict, reps: int, baseline_reps: int) -> None:
    ours_s = time_fn(ours, warmup=1, reps=reps, device=DEVICE)
    base_s = time_fn(baseline, warmup=1, reps=baseline_reps, device=DEVICE)
    row = record(RESULTS, benchmark, "median_time", ours_s, "s", device=device_name(DEVICE),
                 baseline=base_s, ratio=base_s / ours_s, params=params)
    print(f"{benchmark:48} ours {ours_s * 1e3:10.2f} ms   baseline {base_s * 1e3:10.2f} ms   x{row['ratio']:.1f}")


def main() -> None:
    threads = {"threads": torch.get_num_threads()}
    xs = cka_inputs()
    compare("cka_matrix vs per-pair unbiased HSIC loop", lambda: cka_matrix(xs), lambda: cka_matrix_per_pair(xs),
            {**CKA_SHAPE, "unbiased": True, "dtype": str(xs.dtype), **threads}, reps=5, baseline_reps=2)
    del xs

    hidden, mask = covariance_inputs()
    compare("StreamingCovariance.update vs torch.cov", lambda: covariance_streaming(hidden, mask),
            lambda: covariance_torch_cov(hidden, mask),
            {**COV_SHAPE, "chunk": COV_CHUNK, "kept": int(mask.sum()), "normalize": "none", "dtype": str(hidden.dtype),
             **threads},
            reps=5, baseline_reps=5)
    del hidden, mask

    logits = entropy_inputs()
    params = {**ENTROPY_SHAPE, "dtype": "bfloat16", **threads}
    compare("token_entropy vs Categorical.entropy", lambda: token_entropy(logits),
            lambda: categorical_entropy(logits), params, reps=5, baseline_reps=5)
    del logits
    ours_b, base_b = peak_bytes("token_entropy"), peak_bytes("categorical")
    method = "cuda max_memory_allocated" if DEVICE.type == "cuda" else "VmHWM growth, fresh process"
    record(RESULTS, "token_entropy vs Categorical.entropy", "peak_extra_memory", ours_b, "bytes",
           device=device_name(DEVICE), baseline=base_b, ratio=base_b / max(ours_b, 1),
           params={**params, "method": method, "input_bytes": ENTROPY_SHAPE["n"] * ENTROPY_SHAPE["vocab"] * 2})
    print(f"{'token_entropy peak extra memory':48} ours {ours_b / 2**20:10.1f} MiB  baseline {base_b / 2**20:10.1f} MiB  "
          f"x{base_b / max(ours_b, 1):.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Metric benchmarks: elsi-fast vs plain torch, side by side.")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--peak", choices=sorted(ENTROPY_FNS), help=argparse.SUPPRESS)  # subprocess mode
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.peak:
        print(peak_bytes_in_this_process(args.peak))
    else:
        main()
