"""Time and check the metric library against the torch code a user would write instead, and append
the results to bench/results/metrics_<cpu|cuda>.jsonl (ratio = peer / ours: > 1 means elsi-fast
is faster or uses less memory).

    flock /tmp/elsi-bench.lock .venv/bin/python -m bench.run_metrics
    .venv/bin/python -m bench.run_metrics --only cka entropy   # a subset, for development

Peers (bench/bench_metrics.py, built on the references of tests/torch_references.py):
- cka_matrix / MinibatchHSIC: the one-GEMM torch formulation (L full Grams, centered in separate
  passes, flattened, V V^T), at the same precision (fp64 and fp32).
- StreamingCovariance.update: torch.cov per layer, and one batched GEMM x^T x, fp64.
- token_entropy: torch.distributions.Categorical(logits).entropy(), the log_softmax one-liner,
  and torch.compile of the one-liner (compiled once per shape, dtype and thread count).

Every contender runs at 1 and at 2 threads; within one process, each round runs every
(contender, thread count) once in turn, and the medians over rounds are compared, per thread
count and each at its best thread count. Accuracy rows give the max abs error against a float64
reference on the same inputs. Rows record os.getloadavg(): the development machine is shared.

Peak memory of token entropy: on CUDA torch.cuda.max_memory_allocated; on CPU the growth of the
process's peak resident set (VmHWM in /proc/self/status, reset through /proc/self/clear_refs after
the input exists), each measured in a fresh subprocess so freed-but-cached heap from an earlier
measurement cannot hide an allocation.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable

import torch

from bench.bench_metrics import (
    CKA_SHAPE,
    COV_CHUNK,
    COV_SHAPE,
    DEVICE,
    ENTROPY_SHAPES,
    HSIC_BATCH,
    HSIC_SHAPE,
    cka_inputs,
    covariance_inputs,
    covariance_one_gemm,
    covariance_streaming,
    covariance_torch_cov,
    entropy_inputs,
    hsic_inputs,
    hsic_minibatches_one_gemm,
    hsic_minibatches_streaming,
    torch_categorical_entropy,
    torch_cka_one_gemm,
    torch_log_softmax_entropy,
)
from bench.common import device_name, record
from elsi_fast import cka_matrix, token_entropy

RESULTS = f"metrics_{DEVICE.type}"
THREADS = (1, 2)
DTYPE_NAMES = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16"}

# A contender is one callable, or one per thread count (torch.compile bakes the count in).
Contender = Callable[[], object] | dict[int, Callable[[], object]]


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def interleaved(contenders: dict[str, Contender], rounds: int) -> dict[tuple[str, int], float]:
    """Median seconds of every contender at every thread count in THREADS; each round runs each
    (contender, threads) once, in turn, so load changes hit all of them alike."""
    def at(fn: Contender, threads: int) -> Callable[[], object]:
        return fn[threads] if isinstance(fn, dict) else fn

    times: dict[tuple[str, int], list[float]] = {(name, t): [] for name in contenders for t in THREADS}
    for t in THREADS:  # warm-up
        torch.set_num_threads(t)
        for fn in contenders.values():
            at(fn, t)()
    for _ in range(rounds):
        for t in THREADS:
            torch.set_num_threads(t)
            for name, fn in contenders.items():
                _sync()
                start = time.perf_counter()
                at(fn, t)()
                _sync()
                times[(name, t)].append(time.perf_counter() - start)
    torch.set_num_threads(max(THREADS))
    return {key: statistics.median(v) for key, v in times.items()}


def record_ratios(benchmark: str, ours: str, peers: list[str], times: dict[tuple[str, int], float],
                  params: dict, rounds: int) -> None:
    """One row per peer and thread count, and one with each side at its best thread count."""
    common = {**params, "rounds": rounds, "loadavg": [round(x, 2) for x in os.getloadavg()]}
    for peer in peers:
        name = f"{benchmark}: {ours} vs {peer}"
        for t in THREADS:
            o, p = times[(ours, t)], times[(peer, t)]
            record(RESULTS, name, "median_time", o, "s", device=device_name(DEVICE, threads=t), baseline=p,
                   ratio=p / o, params={**common, "threads": t})
            print(f"{name:80} {t}t  ours {o * 1e3:9.1f} ms  peer {p * 1e3:9.1f} ms  x{p / o:.2f}")
        t_ours = min(THREADS, key=lambda t: times[(ours, t)])
        t_peer = min(THREADS, key=lambda t: times[(peer, t)])
        o, p = times[(ours, t_ours)], times[(peer, t_peer)]
        record(RESULTS, name, "median_time_best_threads", o, "s",
               device=device_name(DEVICE, threads=max(THREADS)), baseline=p, ratio=p / o,
               params={**common, "threads_ours": t_ours, "threads_peer": t_peer})
        print(f"{name:80} best ({t_ours}t vs {t_peer}t)  x{p / o:.2f}")


def record_errors(benchmark: str, errors: dict[str, float], params: dict) -> None:
    for name, err in errors.items():
        record(RESULTS, f"{benchmark}: {name}", "max_abs_error_vs_float64", err, "abs",
               device=device_name(DEVICE), params=params)
        print(f"{benchmark + ': ' + name:80} max abs error vs float64 {err:.2e}")


def max_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    return float((got.double() - reference.double()).abs().max())


# ------------------------------------------------------------------ benchmarks


def bench_cka(rounds: int) -> None:
    for dtype in (torch.float64, torch.float32):
        xs = cka_inputs(dtype)
        times = interleaved({"cka_matrix": lambda: cka_matrix(xs, dtype=dtype),
                             "torch one-GEMM": lambda: torch_cka_one_gemm(xs)}, rounds)
        record_ratios(f"cka_matrix L=37 n=512 d=256 unbiased {DTYPE_NAMES[dtype]}", "cka_matrix",
                      ["torch one-GEMM"], times, {**CKA_SHAPE, "unbiased": True, "dtype": str(dtype)}, rounds)
    # Errors against a float64 reference on the same (rounded) inputs: the one-GEMM formula on
    # features centered first in float64 (centering changes neither CKA and keeps offsets out of
    # the Grams).
    def reference(x: torch.Tensor) -> torch.Tensor:
        x = x.double()
        return torch_cka_one_gemm(x - x.mean(1, keepdim=True))

    for case in ("gaussian", "offset_1e4", "outlier_features"):
        x64 = cka_inputs(torch.float64, case)
        x32 = x64.float()
        errors = {
            "cka_matrix fp64": max_error(cka_matrix(x64, dtype=torch.float64), reference(x64)),
            "cka_matrix fp32 (fp64 input)": max_error(cka_matrix(x64, dtype=torch.float32), reference(x64)),
            "cka_matrix fp32 (fp32 input)": max_error(cka_matrix(x32), reference(x32)),
            "torch one-GEMM fp64": max_error(torch_cka_one_gemm(x64), reference(x64)),
            "torch one-GEMM fp32": max_error(torch_cka_one_gemm(x32), reference(x32)),
        }
        record_errors(f"cka_matrix L=37 n=512 d=256 unbiased {case}", errors, {**CKA_SHAPE, "case": case})


def bench_covariance(rounds: int) -> None:
    hidden, mask = covariance_inputs()
    times = interleaved({"StreamingCovariance.update": lambda: covariance_streaming(hidden, mask),
                         "torch.cov": lambda: covariance_torch_cov(hidden, mask),
                         "one-GEMM x^T x": lambda: covariance_one_gemm(hidden, mask)}, rounds)
    params = {**COV_SHAPE, "chunk": COV_CHUNK, "kept": int(mask.sum()), "normalize": "none", "dtype": "torch.float64"}
    record_ratios("covariance L=37 n=4096 d=256 fp64", "StreamingCovariance.update", ["torch.cov", "one-GEMM x^T x"],
                  times, params, rounds)
    hidden, mask = covariance_inputs("offset_1e4")
    reference = covariance_torch_cov(hidden, mask)
    record_errors("covariance L=37 n=4096 d=256 offset_1e4", {
        "StreamingCovariance fp64": max_error(covariance_streaming(hidden, mask), reference),
        "one-GEMM x^T x fp64": max_error(covariance_one_gemm(hidden, mask), reference),
        "one-GEMM x^T x fp32": max_error(covariance_one_gemm(hidden.float(), mask), reference),
    }, {**params, "case": "offset_1e4", "reference": "torch.cov fp64"})


def bench_minibatch_hsic(rounds: int) -> None:
    hidden = hsic_inputs()
    times = interleaved({"MinibatchHSIC.update": lambda: hsic_minibatches_streaming(hidden),
                         "torch one-GEMM": lambda: hsic_minibatches_one_gemm(hidden)}, rounds)
    params = {**HSIC_SHAPE, "minibatch": HSIC_BATCH, "normalize": "none", "dtype": "torch.float64"}
    record_ratios("MinibatchHSIC L=37 2 x 512 tokens d=256 fp64", "MinibatchHSIC.update", ["torch one-GEMM"],
                  times, params, rounds)
    ours, peer = hsic_minibatches_streaming(hidden), hsic_minibatches_one_gemm(hidden)
    scale = float(peer[0].abs().max())
    print(f"MinibatchHSIC vs one-GEMM: max rel difference {max_error(ours[0], peer[0]) / scale:.1e}")


def _compiled_one_liner(threads: int, logits: torch.Tensor) -> tuple[Callable[[], object], float]:
    """torch.compile of the log_softmax one-liner at `threads` threads, compiled now; returns the
    call and the compile seconds. A copy of the function's code per thread count gets its own
    compiled graph, since Inductor fixes the thread count of the code it generates."""
    torch.set_num_threads(threads)
    fn = torch_log_softmax_entropy
    clone = types.FunctionType(fn.__code__.replace(co_name=f"{fn.__name__}_{threads}t"), fn.__globals__)
    compiled = torch.compile(clone, dynamic=False)
    start = time.perf_counter()
    compiled(logits)
    return (lambda: compiled(logits)), time.perf_counter() - start


def bench_entropy(rounds: int) -> None:
    for shape in ENTROPY_SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            logits = entropy_inputs(**shape, dtype=dtype)
            compiled, compile_s = {}, {}
            for t in THREADS:
                compiled[t], compile_s[t] = _compiled_one_liner(t, logits)
            contenders = {"token_entropy": lambda: token_entropy(logits),
                          "torch.compile(log_softmax one-liner)": compiled,
                          "log_softmax one-liner": lambda: torch_log_softmax_entropy(logits),
                          "Categorical.entropy": lambda: torch_categorical_entropy(logits)}
            times = interleaved(contenders, rounds)
            params = {**shape, "dtype": str(dtype), "compile_s": {str(t): round(s, 1) for t, s in compile_s.items()}}
            name = f"token entropy {shape['n']} x {shape['vocab']} {DTYPE_NAMES[dtype]}"
            record_ratios(name, "token_entropy", [c for c in contenders if c != "token_entropy"], times, params, rounds)
            logp = logits.double().log_softmax(-1)
            reference = -(logp.exp() * logp).sum(-1)
            calls = {c: fn[max(THREADS)] if isinstance(fn, dict) else fn for c, fn in contenders.items()}
            record_errors(name, {c: max_error(call(), reference) for c, call in calls.items()}, params)


PEAK_FNS = ("token_entropy", "log_softmax one-liner", "Categorical.entropy", "torch.compile(log_softmax one-liner)")


def peak_bytes_in_this_process(name: str, vocab: int, dtype: str) -> int:
    """Peak extra memory of one call of contender `name` on a fresh [64, vocab] input."""
    logits = entropy_inputs(64, vocab, getattr(torch, dtype))
    fn = {"token_entropy": token_entropy, "log_softmax one-liner": torch_log_softmax_entropy,
          "Categorical.entropy": torch_categorical_entropy}.get(name)
    if fn is None:  # compiled in a throwaway call first: compilation memory is not the kernel's
        fn = torch.compile(torch_log_softmax_entropy, dynamic=False)
        fn(entropy_inputs(64, vocab, getattr(torch, dtype)))
    else:  # one tiny call pays torch's lazy initialization without caching large blocks
        fn(entropy_inputs(2, 1000, getattr(torch, dtype)))
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


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def bench_entropy_memory() -> None:
    for shape in ENTROPY_SHAPES:
        for dtype in ("bfloat16", "float32"):
            peaks = {}
            for name in PEAK_FNS:
                out = subprocess.run([sys.executable, "-m", "bench.run_metrics", "--peak", name, str(shape["vocab"]), dtype],
                                     check=True, capture_output=True, text=True,
                                     env={**os.environ, "BENCH_DEVICE": DEVICE.type})
                peaks[name] = int(out.stdout.strip().splitlines()[-1])
            ours = peaks["token_entropy"]
            method = "cuda max_memory_allocated" if DEVICE.type == "cuda" else "VmHWM growth, fresh process"
            label = f"token entropy {shape['n']} x {shape['vocab']} {DTYPE_NAMES[getattr(torch, dtype)]}"
            params = {**shape, "dtype": dtype, "method": method, "loadavg": [round(x, 2) for x in os.getloadavg()]}
            for name in PEAK_FNS[1:]:
                bench = f"{label}: token_entropy vs {name}"
                record(RESULTS, bench, "peak_extra_memory", ours, "bytes", device=device_name(DEVICE),
                       baseline=peaks[name], ratio=peaks[name] / max(ours, 1), params=params)
                print(f"{bench:80} ours {ours / 2**20:7.1f} MiB  peer {peaks[name] / 2**20:7.1f} MiB")


BENCHES = {"cka": bench_cka, "covariance": bench_covariance, "hsic": bench_minibatch_hsic, "entropy": bench_entropy}


def main(only: list[str], rounds: int) -> None:
    for name in only:
        if name == "entropy_memory":
            bench_entropy_memory()
        else:
            BENCHES[name](rounds)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Metric benchmarks: elsi-fast vs the torch peers, interleaved.")
    parser.add_argument("--only", nargs="+", choices=[*BENCHES, "entropy_memory"],
                        default=[*BENCHES, "entropy_memory"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--peak", nargs=3, metavar=("NAME", "VOCAB", "DTYPE"), help=argparse.SUPPRESS)  # subprocess
    args = parser.parse_args()
    if args.peak:
        torch.set_num_threads(1)
        print(peak_bytes_in_this_process(args.peak[0], int(args.peak[1]), args.peak[2]))
    else:
        main(args.only, args.rounds)
