"""Verify-forward cost of SmolLM2-135M-Instruct on the target runtime against eager torch.

Speculative decoding gains only what the target's verify forward of k+1 tokens allows: in eager
torch on a 2-core Zen 3 it cost 1.75-2x a 1-token forward (docs/target-runtime.md). Here SmolLM2
(fp32 model, 30 blocks) at a --context token KV cache runs forwards of T = 1, 2, 3, 5, 8 tokens,
each rolled back afterwards as speculative decoding rolls back rejected positions. Contenders:
  torch       the model as loaded (eager, sdpa attention, DynamicCache);
  rt-fp32, rt-bf16, rt-int8
              the same model on `elsi_fast.targets.target_runtime.accelerate` with fp32 / bf16 / int8 weights;
  compile, rt-<w>+compile
              (--compile) `torch.compile(model.forward, dynamic=True)` of the eager model and of each
              runtime model (the runtime's ops have fake kernels; a crop of the cache changes its
              strides, so every model compiles three times: 1 token, more tokens, cropped cache);
at 1 and 2 threads, timed round-robin in one process (each round runs every contender, thread
count and T once; medians over --reps rounds). Every weight page is touched first (the model is
loaded memory-mapped, and the runtime reads the token embedding only row by row).
  -> bench/results/target_runtime_cpu.jsonl:
     forward_ms         per contender, threads, T; baseline: torch eager at the same threads and T
                        (ratio = baseline / value, the speedup);
     verify_cost_ratio  per contender, threads, T > 1: t(T) / t(1) (TARGET: <= 1.25 up to T = 5).
--busy N starts N processes that spin on the CPU for the duration (the busy-neighbour case; the
machine's own background load counts too: every row holds the load average before and after).

Run from the repository root: `python -m bench.bench_target_runtime [--reps 7] [--busy 1] [--compile]`.
"""

from __future__ import annotations

import os

# torch's OpenMP workers spin-wait by default, which on a shared CPU stalls every 2-thread op
# (elsi_fast/_infra/threads.py); the CLI sets this before torch loads, and so does this benchmark.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import copy  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402

from bench.common import device_name, record  # noqa: E402
from elsi_fast.decoding.speculative import cache_kwarg  # noqa: E402
from elsi_fast.targets import target_runtime  # noqa: E402
from elsi_fast.targets.loading import load_model  # noqa: E402

MODEL = "smollm2-135m-instruct"
TOKENS = (1, 2, 3, 5, 8)
THREADS = (1, 2)
RESULTS = "target_runtime_cpu"


def _spinners(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


class Contender:
    """A model (eager, compiled or on the runtime) with its own KV cache holding the context."""

    def __init__(self, name: str, model, forward: Callable, context: torch.Tensor):
        from transformers import DynamicCache

        self.name = name
        self.model = model
        self.forward = forward
        self.cache = DynamicCache(config=model.config)
        self.kwargs = {cache_kwarg(model): self.cache, "use_cache": True}
        with torch.no_grad():
            model(input_ids=context, **self.kwargs)  # the prefill: torch's GEMM either way
        self.context = context.shape[1]

    @torch.no_grad()
    def time_forward(self, tokens: int, gen: torch.Generator) -> float:
        ids = torch.randint(0, self.model.config.vocab_size, (1, tokens), generator=gen)
        start = time.perf_counter()
        self.forward(input_ids=ids, **self.kwargs)
        seconds = time.perf_counter() - start
        self.cache.crop(-tokens)
        return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--threads", type=int, nargs="+", default=list(THREADS))
    parser.add_argument("--weights", nargs="+", default=list(target_runtime.WEIGHT_DTYPES),
                        choices=target_runtime.WEIGHT_DTYPES, help="runtime weight dtypes to time")
    parser.add_argument("--busy", type=int, default=0, help="spinning neighbour processes during the timings")
    parser.add_argument("--compile", action="store_true",
                        help="also time torch.compile of the eager and of every runtime model (minutes each)")
    parser.add_argument("--no-record", action="store_true", help="print only")
    args = parser.parse_args()
    args.tokens = sorted(set(args.tokens) | {1})  # the ratios are to T = 1

    model, _ = load_model(MODEL, device="cpu", dtype="float32", progress=False)
    with torch.no_grad():
        for p in model.parameters():
            p.sum()  # fault every memory-mapped page in
    context = torch.randint(0, model.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    contenders = [Contender("torch", model, model, context)]
    runtimes = []
    for dtype in args.weights:
        copy_ = copy.deepcopy(model)
        runtimes.append(target_runtime.accelerate(copy_, dtype))
        contenders.append(Contender(f"rt-{dtype}", copy_, copy_, context))
    compile_seconds = {}
    if args.compile:
        # The models share one forward code object, and each compiles for 1 token, more tokens and a
        # cropped cache: past dynamo's default limit of 8 variants the forwards would run eager.
        for limit in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, limit):
                setattr(torch._dynamo.config, limit, 64)
        for c in list(contenders):
            # the same model (weights, runtime patches), its own KV cache
            name = "compile" if c.name == "torch" else f"{c.name}+compile"
            contender = Contender(name, c.model, torch.compile(c.model.forward, dynamic=True), context)
            start = time.perf_counter()
            for _ in range(2):  # every shape class and the cropped cache's strides, before timing
                for tokens in args.tokens:
                    contender.time_forward(tokens, torch.Generator().manual_seed(1))
            compile_seconds[name] = time.perf_counter() - start
            contenders.append(contender)

    spinners = _spinners(args.busy)
    try:
        load_before = os.getloadavg()
        gen = torch.Generator().manual_seed(2)
        for threads in args.threads:  # warm-up: every contender, thread count and T once
            torch.set_num_threads(threads)
            for c in contenders:
                for tokens in args.tokens:
                    c.time_forward(tokens, gen)
        times: dict[tuple[str, int, int], list[float]] = {}
        for _ in range(args.reps):
            for threads in args.threads:
                torch.set_num_threads(threads)
                for c in contenders:
                    for tokens in args.tokens:
                        times.setdefault((c.name, threads, tokens), []).append(c.time_forward(tokens, gen))
        load_after = os.getloadavg()
    finally:
        for p in spinners:
            p.kill()
            p.wait()

    median_ms = {key: statistics.median(v) * 1e3 for key, v in times.items()}
    common = {"model": MODEL, "context": args.context, "reps": args.reps, "busy_neighbours": args.busy,
              "load_average_before": [round(x, 2) for x in load_before],
              "load_average_after": [round(x, 2) for x in load_after],
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "isa": target_runtime._C.cpu_isa()}
    describe = {c.name: "torch eager (sdpa, DynamicCache)" for c in contenders}
    describe.update({f"rt-{rt.weight_dtype}": f"elsi-fast target runtime, {rt.weight_dtype} weights "
                     f"({rt.weight_bytes / 2**20:.0f} MiB packed), {len(rt.linears)} linears, {len(rt.norms)} norms, "
                     "native attention" for rt in runtimes})
    for name, seconds in compile_seconds.items():
        base = describe["torch" if name == "compile" else name.removesuffix("+compile")]
        describe[name] = f"torch.compile(dynamic=True) of {base}; {seconds:.0f} s of compiling and warm-up"
    print(f"load average {load_before} -> {load_after}, busy neighbours {args.busy}")
    print(f"{'contender':10} {'thr':>3} " + " ".join(f"{'T=' + str(t):>8}" for t in args.tokens) + "   T/T1")
    for c in contenders:
        for threads in args.threads:
            row = [median_ms[(c.name, threads, t)] for t in args.tokens]
            ratios = [r / row[0] for r in row]
            print(f"{c.name:10} {threads:3d} " + " ".join(f"{v:8.1f}" for v in row) + "   "
                  + " ".join(f"{x:.2f}" for x in ratios))
            if args.no_record:
                continue
            device = device_name("cpu", threads)
            for tokens, value in zip(args.tokens, row):
                baseline = median_ms[("torch", threads, tokens)]
                record(RESULTS, "target_verify_forward", "forward_ms", value, "ms", device=device, baseline=baseline,
                       ratio=baseline / value,
                       params={**common, "contender": c.name, "backend": describe[c.name], "threads": threads,
                               "tokens": tokens})
                if tokens > 1:
                    record(RESULTS, "target_verify_forward", "verify_cost_ratio", value / row[0], "x", device=device,
                           baseline=row[0], ratio=None,
                           params={**common, "contender": c.name, "backend": describe[c.name], "threads": threads,
                                   "tokens": tokens, "k": tokens - 1, "target": 1.25})


if __name__ == "__main__":
    main()
