"""Layer-selection benchmark: the searches after the pass, against today's implementation.

    python -m bench.bench_selection synthetic --layers 33 --prompts 480 --m 1 2 3 --today
    python -m bench.bench_selection synthetic --layers 81 --prompts 2000 --m 1 2 3 4
    python -m bench.bench_selection e2e --layers 33 --prompts 480 --m 1 2 3 --today

synthetic: per-prompt prompt-mode vectors shaped like a real pass (128 tokens, d = 256 > n as in
           real models, low effective rank: a 48-dim latent with decaying scales, mixed by a
           per-layer map that drifts with depth, plus depth-dependent noise). The new store is
           built from them (timed apart: that work belongs to the pass), then every selection of
           LayerReport.compute_selections (ELSI, ELSI-C, low-entropy exhaustive or greedy, uniform,
           EAGLE3, last, the pair-gain matrix) runs on it. With --today, the same vectors go
           through today's implementation (fp16 Grams of at most 128 tokens, one eigensolve per
           prompt for every set the searches visit, Shannon pair gains), and the picks of both are
           compared (today's store rounds to fp16, so values differ by ~1e-3 nats; picks may too).
e2e:       elsi_fast.analyze on a random Llama (d = 64, V = 512, stories260K's tokenizer) over
           Spec-Bench prompts, min_token_entropy = 0: pass and selection time; with --today,
           today's implementation (the package at commit TODAY, extracted from git) in a
           subprocess on the same model and prompts.
Each configuration runs in a fresh process so that its peak RSS (ru_maxrss) is its own. Rows go to
bench/results/selection_cpu.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench.common import device_name, record, shared_data
from elsi_fast.analysis import selection as sel
from elsi_fast.analysis.prompt_store import PromptModeStore
from elsi_fast.analysis.report import LayerReport
from elsi_fast.analysis.set_entropy import SetEntropySolver
from elsi_fast.metrics import normalize_tokens, spectrum_entropy

TODAY = "5b4ce62"  # the commit before issue 11


class TodayPromptStore:
    """Today's prompt-mode store and set entropy (elsi_fast.analysis.PromptGrams at TODAY, now prompt_store.PromptModeStore + set_entropy.SetEntropySolver): per
    prompt the [L, g, g] fp16 Grams of at most 128 evenly spaced tokens, and per set one fp32
    eigensolve per prompt, 32 matrices per batched call."""

    def __init__(self) -> None:
        self.grams: list[torch.Tensor] = []
        self._cache: dict[tuple[int, ...], float] = {}

    def add(self, z: torch.Tensor) -> None:
        n = z.shape[1]
        if n > 128:
            z = z[:, torch.linspace(0, n - 1, 128).round().long()]
        self.grams.append((z @ z.transpose(-2, -1)).to(torch.float16))

    def _entropy(self, grams: torch.Tensor) -> torch.Tensor:
        flat = grams.reshape(-1, *grams.shape[-2:])
        eigvals = torch.cat([torch.linalg.eigvalsh(part) for part in flat.split(32)]).view(grams.shape[:-1])
        scale = grams.diagonal(dim1=-2, dim2=-1).amax(-1, keepdim=True)
        tolerance = grams.shape[-1] * torch.finfo(torch.float16).eps * scale
        return spectrum_entropy(torch.where(eigvals.abs() <= tolerance, eigvals.clamp_min(0), eigvals))

    def set_entropy(self, sets):
        keys = [tuple(sorted(set(int(a) for a in s))) for s in sets]
        todo = sorted({k for k in keys if k not in self._cache})
        if todo:
            size = max(g.shape[-1] for g in self.grams)
            step = max(1, (1 << 23) // (self.grams[0].shape[0] * size * size))
            totals = np.zeros(len(todo))
            for start in range(0, len(self.grams), step):
                part = self.grams[start : start + step]
                padded = torch.zeros(len(part), part[0].shape[0], size, size)
                for i, g in enumerate(part):
                    padded[i, :, : g.shape[-1], : g.shape[-1]] = g
                for k, layer_set in enumerate(todo):
                    totals[k] += float(self._entropy(padded[:, list(layer_set)].sum(1)).sum())
            self._cache.update(zip(todo, (totals / len(self.grams)).tolist()))
        return np.array([self._cache[k] for k in keys])


def synthetic_vectors(num_layers: int, num_prompts: int, tokens: int = 128, dim: int = 256, seed: int = 0):
    """Yields [num_layers, tokens, dim] float64 prompt-mode vectors, one prompt at a time."""
    rng = np.random.default_rng(seed)
    latent = 48
    scales = np.arange(1, latent + 1) ** -0.8
    maps = [rng.normal(size=(latent, dim))]
    for _ in range(num_layers - 1):
        maps.append(np.cos(0.3) * maps[-1] + np.sin(0.3) * rng.normal(size=(latent, dim)))
    depth = np.linspace(0, 1, num_layers)
    noise = 0.05 + 0.25 * np.sin(np.pi * depth)  # the "activation wave": more spread mid-depth
    for _ in range(num_prompts):
        t = rng.normal(size=(tokens, latent)) * scales
        x = np.stack([t @ m + s * rng.normal(size=(tokens, dim)) for m, s in zip(maps, noise)])
        yield normalize_tokens(torch.from_numpy(x), "center_l2")


def _report(num_layers: int, cka: np.ndarray, m: list[int], set_entropy, set_renyi2) -> LayerReport:
    return LayerReport(
        model="synthetic", num_hidden_layers=num_layers - 1, layers=[], cka=cka.tolist(), tokens={},
        options={"m": m, "candidates": list(range(1, num_layers - 1))},
        set_entropy=set_entropy, set_renyi2=set_renyi2,
    )


def _peak_rss() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0


def run_synthetic(args) -> dict:
    """One configuration, in this process: build, select, (today), return the figures."""
    torch.set_num_threads(args.threads)
    out: dict = {}
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        store = PromptModeStore(256, os.path.join(tmp, "factors"))
        today = TodayPromptStore() if args.today else None
        started = time.perf_counter()
        build_today = 0.0
        for i, z in enumerate(synthetic_vectors(args.layers, args.prompts)):
            store.add(i, z)
            if today is not None:
                t0 = time.perf_counter()
                today.add(z.float())
                build_today += time.perf_counter() - t0
        out["store_build_seconds"] = time.perf_counter() - started - build_today
        out["store_file_bytes"] = store.nbytes
        out["store_ram_bytes"] = store.ram_bytes
        _, trace, frob = store.stacked()
        cka = (frob / np.sqrt(np.einsum("pii->pi", frob)[:, :, None] * np.einsum("pii->pi", frob)[:, None, :])).mean(0)
        rss_before = _peak_rss()

        solver = SetEntropySolver(store)
        objective = sel.ScreenedObjective(solver.prompt_set_entropy, solver.surrogate, len(store))
        report = _report(args.layers, cka, args.m, objective, solver.renyi2_entropy)
        started = time.perf_counter()
        report.compute_selections()
        out["selection_seconds"] = time.perf_counter() - started
        out["peak_rss_bytes"] = _peak_rss()
        out["counts"] = {**objective.counts, "prompt_set_eigensolves": solver.solves}
        out["selections"] = report.selections
        out["set_values"] = report.set_values
        out["rss_before_selection_bytes"] = rss_before
        if today is not None:
            report_today = _report(args.layers, cka, args.m, today.set_entropy, today.set_entropy)
            started = time.perf_counter()
            report_today.compute_selections()
            out["today_selection_seconds"] = time.perf_counter() - started
            out["today_prompt_set_eigensolves"] = len(today._cache) * args.prompts
            out["today_store_bytes"] = sum(g.numel() * g.element_size() for g in today.grams)
            out["today_selections"] = report_today.selections
    return out


E2E_CHILD = r"""
import json, resource, sys, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
try:
    from elsi_fast.analysis.analyze import analyze
    from elsi_fast.analysis.prompts import load_prompts
    from elsi_fast.targets.llama2c import load_llama2c_tokenizer
except ModuleNotFoundError:  # the package at TODAY, before its subpackages
    from elsi_fast.analysis import analyze
    from elsi_fast.llama2c import load_llama2c_tokenizer
    from elsi_fast.prompts import load_prompts
layers, prompts_count, m, stories, spec, state, threads = json.loads(sys.argv[1])
torch.set_num_threads(threads)
torch.manual_seed(0)
config = LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=layers, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024)
model = LlamaForCausalLM(config).eval()
tokenizer = load_llama2c_tokenizer(stories)
prompts = load_prompts(spec, max_prompts=prompts_count)
started = time.perf_counter()
report = analyze(model, tokenizer, prompts, m=m, min_token_entropy=0, progress=False, state_path=state)
total = time.perf_counter() - started
print(json.dumps({"timing": report.timing, "total_seconds": total, "memory": report.memory,
                  "selections": report.selections, "set_values": report.set_values,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0}))
"""


def run_e2e_child(args, package_root: str, state: str | None) -> dict:
    env = dict(os.environ, PYTHONPATH=package_root, OMP_NUM_THREADS=str(args.threads))
    stories = str(shared_data("models", "stories260K", "stories260K.bin"))
    spec_bench = str(shared_data("prompts", "spec_bench_question.jsonl"))
    payload = json.dumps([args.layers, args.prompts, args.m, stories, spec_bench, state, args.threads])
    done = subprocess.run([sys.executable, "-c", E2E_CHILD, payload], env=env, capture_output=True, text=True,
                          check=True, cwd=package_root)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("part", choices=("synthetic", "e2e"))
    parser.add_argument("--layers", type=int, default=33,
                        help="synthetic: hidden states L (N = L - 1 blocks); e2e: blocks N of the random Llama")
    parser.add_argument("--prompts", type=int, default=480)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--today", action="store_true", help="also run today's implementation (slow)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tmp", default=None, help="folder for the spill files")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--note", default="other helpers compiled and tested on the machine meanwhile",
                        help="recorded in the rows' params: the conditions of the run")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_synthetic(args)))
        return
    load = os.getloadavg()
    device = device_name("cpu", args.threads)
    base = {"layers": args.layers, "prompts": args.prompts, "m": args.m, "threads": args.threads}
    if args.part == "synthetic":
        argv = [sys.executable, "-m", "bench.bench_selection", "synthetic", "--child", "--layers", str(args.layers),
                "--prompts", str(args.prompts), "--threads", str(args.threads), "--m", *map(str, args.m)]
        if args.today:
            argv.append("--today")
        if args.tmp:
            argv += ["--tmp", args.tmp]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        result = json.loads(subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
        params = {**base, "source": "synthetic: 128 tokens, d=256, 48-dim latent with decaying scales",
                  "today": "same run, same vectors" if args.today else "not run (too slow at this size: one eigensolve "
                  "per prompt for every visited set)", "counts": result["counts"],
                  "store_file_bytes": result["store_file_bytes"], "store_ram_bytes": result["store_ram_bytes"],
                  "store_build_seconds": result["store_build_seconds"], "loadavg_before": load,
                  "loadavg_after": os.getloadavg(), "note": args.note}
        if args.today:
            params["picks_equal_today"] = result["selections"] == result["today_selections"]
            params["today_store_bytes"] = result["today_store_bytes"]
            params["today_prompt_set_eigensolves"] = result["today_prompt_set_eigensolves"]
        print(json.dumps({k: v for k, v in result.items() if k not in ("selections", "set_values", "today_selections")}, indent=1))
        if args.no_record:
            return
        today = result.get("today_selection_seconds")
        record("selection_cpu", "selection_synthetic", "selection_seconds", result["selection_seconds"], "s",
               device=device, baseline=today, ratio=None if today is None else today / result["selection_seconds"],
               params=params)
        record("selection_cpu", "selection_synthetic", "peak_rss", result["peak_rss_bytes"] / 2**30, "GiB",
               device=device, params={**params, "rss_before_selection_GiB": result["rss_before_selection_bytes"] / 2**30})
        return

    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        new = run_e2e_child(args, ROOT, os.path.join(tmp, "state.pt"))
        today = None
        if args.today:
            old_root = os.path.join(tmp, "today")
            os.makedirs(old_root)
            archive = subprocess.run(["git", "archive", TODAY, "elsi_fast"], cwd=ROOT, capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", old_root], input=archive, check=True)
            today = run_e2e_child(args, old_root, None)
    params = {**base, "model": "random Llama d=64, V=512, stories260K tokenizer", "prompts_file": "spec_bench_question",
              "min_token_entropy": 0, "new": new["timing"], "store": new["memory"],
              "today": None if today is None else {"timing": today["timing"], "total_seconds": today["total_seconds"],
                                                   "peak_rss_bytes": today["peak_rss_bytes"],
                                                   "selection_seconds": today["total_seconds"] - today["timing"]["pass_seconds"]},
              "loadavg_before": load, "loadavg_after": os.getloadavg(),
              "note": args.note}
    if today is not None:
        params["picks_equal_today"] = new["selections"] == today["selections"]
    print(json.dumps(params, indent=1))
    if args.no_record:
        return
    selection = new["timing"]["selection_seconds"]
    today_selection = None if today is None else params["today"]["selection_seconds"]
    record("selection_cpu", "selection_e2e", "selection_seconds", selection, "s", device=device, baseline=today_selection,
           ratio=None if today is None else today_selection / selection, params=params)
    record("selection_cpu", "selection_e2e", "selection_over_pass", selection / new["timing"]["pass_seconds"], "ratio",
           device=device, params=params)
    record("selection_cpu", "selection_e2e", "peak_rss", new["peak_rss_bytes"] / 2**30, "GiB", device=device,
           baseline=None if today is None else today["peak_rss_bytes"] / 2**30, params=params)


if __name__ == "__main__":
    main()
