"""Analysis benchmark: cost of the streaming statistics over a bare forward, and memory vs prompts.

    python -m bench.bench_analysis [--device cuda] [--part overhead memory threshold]

overhead:  analyze()'s pass time / bare forward time (the model's own forward, logits included) of
           the same batches (same tokens, batch size and length-sorted order), for SmolLM2-135M-
           Instruct on Spec-Bench (the real target; a random model of its config when its package
           is not installed, e.g. on the GPU machine), Gemma 3 270M, stories260K and a random Llama
           of hidden 512;
           interleaved forward / pass / forward / pass (target: <= 1.15x).
memory:    peak memory of a run vs the number of prompts, each run in a fresh process (CPU: peak
           RSS over the RSS after loading, Linux only; CUDA: torch.cuda.max_memory_allocated), with the
           report's own accounting of the prompt-mode Gram store and the accumulators.
threshold: kept fraction and cross-prompt variance reduction of per-layer entropy vs the token
           entropy threshold on stories260K (the basis of the default min_token_entropy).
Rows go to bench/results/analysis_<device type>.jsonl.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys

import torch

from bench.common import device_name, record, shared_data, time_fn
from elsi_fast.analysis.analyze import analyze
from elsi_fast.analysis.prompts import encode_prompt, load_prompts
from elsi_fast.targets.llama2c import load_llama2c, load_llama2c_tokenizer



def _stories() -> str:
    return str(shared_data("models", "stories260K", "stories260K.bin"))


def _spec_bench() -> str:
    return str(shared_data("prompts", "spec_bench_question.jsonl"))


def stories(device: str):
    return load_llama2c(_stories()).to(device), load_llama2c_tokenizer(_stories())


def random_llama(device: str, dtype: torch.dtype):
    """A random Llama with real-model proportions at small size (d=512, 8 blocks, V=32000)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=32000, max_position_embeddings=1024)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval(), load_llama2c_tokenizer(_stories())


def smollm2(device: str, dtype: torch.dtype):
    """SmolLM2-135M-Instruct from its package, else a random model of its config (same shapes)."""
    try:
        from elsi_fast.targets.loading import load_model

        model, tokenizer = load_model("smollm2-135m-instruct", device=device, dtype=str(dtype).removeprefix("torch."))
        return model, tokenizer, "SmolLM2-135M-Instruct"
    except ValueError:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                             num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
                             max_position_embeddings=8192)
        model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
        return model, load_llama2c_tokenizer(_stories()), "random model of SmolLM2-135M's config"


def gemma3(device: str, dtype: torch.dtype):
    """Gemma 3 270M from its packages (18 blocks, sliding-window layers, vocabulary 262144)."""
    from elsi_fast.targets.loading import load_model

    model, tokenizer = load_model("gemma3-270m", device=device, dtype=str(dtype).removeprefix("torch."))
    return model, tokenizer, "Gemma-3-270M"


def bare_forward_seconds(model, token_ids: list[list[int]], batch_size: int, device: str, reps: int = 3) -> float:
    """The model's own forward (logits included) over the batches the pass forms: longest prompts
    first, `batch_size` at a time, right-padded."""
    batches = []
    token_ids = sorted(token_ids, key=len, reverse=True)
    for start in range(0, len(token_ids), batch_size):
        chunk = token_ids[start : start + batch_size]
        width = max(map(len, chunk))
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for b, row in enumerate(chunk):
            ids[b, : len(row)] = torch.tensor(row)
            mask[b, : len(row)] = 1
        batches.append((ids.to(device), mask.to(device)))

    def run():
        with torch.inference_mode():
            for ids, mask in batches:
                model(input_ids=ids, attention_mask=mask, use_cache=False)

    return time_fn(run, warmup=0, reps=reps, device=device)


def part_overhead(device: str, num_prompts: int, out: str, models: list[str], reps: int) -> None:
    prompts = load_prompts(_spec_bench(), max_prompts=num_prompts)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    builders = {"smollm2": lambda: smollm2(device, dtype),
                "gemma3": lambda: gemma3(device, dtype),
                "stories260K": lambda: (*stories(device), "stories260K"),
                "llama-d512-random": lambda: (*random_llama(device, dtype), "llama-d512-random")}
    for key in models:
        model, tokenizer, name = builders[key]()
        ids = [encode_prompt(p, tokenizer)[:512] for p in prompts]
        bare_forward_seconds(model, ids[:8], 8, device, reps=1)  # warm-up
        forwards, passes = [], []
        for _ in range(reps):  # interleaved, so that drifting machine speed hits both alike
            forwards.append(bare_forward_seconds(model, ids, 8, device, reps=1))
            report = analyze(model, tokenizer, prompts, m=(1, 3), batch_size=8, max_tokens=512, progress=False)
            passes.append(report.timing["pass_seconds"])
        forward, pass_seconds = sorted(forwards)[len(forwards) // 2], sorted(passes)[len(passes) // 2]
        tokens = report.tokens["total"]
        params = {"model": name, "prompts": num_prompts, "tokens": tokens, "batch_size": 8, "dtype": str(dtype),
                  "threads": torch.get_num_threads(), "reps": reps, "forwards_s": forwards, "passes_s": passes,
                  "kept_fraction": report.tokens["kept_fraction"], "loadavg": os.getloadavg()}
        record(out, "analysis_overhead", "pass_over_forward", pass_seconds / forward, "x", device=device_name(device),
               baseline=forward, ratio=pass_seconds / forward, params={**params, "pass_s": pass_seconds, "forward_s": forward})
        print(f"{name}: forward {forward:.3f}s, analysis pass {pass_seconds:.3f}s -> {pass_seconds / forward:.2f}x "
              f"({tokens / pass_seconds:.0f} tok/s)", flush=True)


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _memory_child(device: str, num_prompts: int) -> dict:
    model, tokenizer = stories(device)
    prompts = load_prompts(_spec_bench(), max_prompts=num_prompts)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        # Reset the process's peak RSS (Linux clear_refs "5") so imports and model loading don't count.
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _rss_bytes("VmRSS")
    report = analyze(model, tokenizer, prompts, m=(1, 3), progress=False)
    if device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _rss_bytes("VmHWM") - base
    return {"peak_bytes": peak, **report.memory, "tokens": report.tokens["total"]}


def part_memory(device: str, counts: list[int], out: str) -> None:
    for count in counts:
        result = subprocess.run(
            [sys.executable, "-m", "bench.bench_analysis", "--device", device, "--memory-child", str(count)],
            check=True, capture_output=True, text=True,
        )
        row = json.loads(result.stdout.strip().splitlines()[-1])
        record(out, "analysis_memory", "peak_growth", row["peak_bytes"] / 2**20, "MiB", device=device_name(device),
               params={"model": "stories260K", "prompts": count, **row})
        print(f"{count:4d} prompts: peak growth {row['peak_bytes'] / 2**20:7.1f} MiB, Gram store "
              f"{row['gram_store_bytes'] / 2**20:6.1f} MiB, accumulators {row['accumulator_bytes'] / 2**20:.2f} MiB")


def part_threshold(device: str, num_prompts: int, thresholds: list[float], out: str) -> None:
    """gram_tokens=128 compares each prompt's kept tokens with all its tokens; gram_tokens=32 caps
    both to 32 evenly spaced tokens, separating *which* tokens are kept from *how many*
    (prompt-mode entropy grows with the token count)."""
    model, tokenizer = stories(device)
    sources = {
        "spec_bench": _spec_bench(),
        "tinystories": str(shared_data("corpus", "tinystories_valid_part.txt")),
    }
    for source, path in sources.items():
        prompts = load_prompts(path, max_prompts=num_prompts)
        for gram_tokens, threshold in itertools.product((128, 32), thresholds):
            report = analyze(model, tokenizer, prompts, m=(1,), min_token_entropy=threshold, max_tokens=256,
                             gram_tokens=gram_tokens, progress=False)
            variance = report.entropy_variance
            record(out, "analysis_threshold", "variance_reduction", variance["reduction"], "fraction",
                   device=device_name(device),
                   params={"model": "stories260K", "prompts": source, "count": num_prompts, "threshold": threshold,
                           "gram_tokens": gram_tokens, "kept_fraction": report.tokens["kept_fraction"], **variance})
            print(f"{source:<12} gram_tokens {gram_tokens:3d} threshold {threshold:4.2f}: kept "
                  f"{100 * report.tokens['kept_fraction']:5.1f}%, variance {variance['unfiltered']:.5f} -> "
                  f"{variance['filtered']:.5f} ({100 * variance['reduction']:+.1f}%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--part", nargs="+", default=["overhead", "memory", "threshold"])
    parser.add_argument("--prompts", type=int, default=480, help="Spec-Bench prompts of the overhead part (default all)")
    parser.add_argument("--models", nargs="+", default=["smollm2"], choices=["smollm2", "gemma3", "stories260K", "llama-d512-random"])
    parser.add_argument("--reps", type=int, default=2, help="interleaved forward / pass repetitions (medians)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--memory-counts", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0])
    parser.add_argument("--threshold-prompts", type=int, default=96)
    parser.add_argument("--memory-child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.memory_child is not None:
        print(json.dumps(_memory_child(args.device, args.memory_child)))
        return
    out = f"analysis_{torch.device(args.device).type}"
    if "overhead" in args.part:
        part_overhead(args.device, args.prompts, out, args.models, args.reps)
    if "memory" in args.part:
        part_memory(args.device, args.memory_counts, out)
    if "threshold" in args.part:
        part_threshold(args.device, args.threshold_prompts, args.thresholds, out)


if __name__ == "__main__":
    main()
