"""End-to-end speed of speculative decoding on a real target: SmolLM2-135M-Instruct on elsi-fast's
target runtime, its trained native ELSI m=1 EAGLE3 draft against the target's own greedy decoding
and prompt lookup, on Spec-Bench prompts.

    python -m bench.bench_spec_e2e --draft runs/draft-experiment/smollm2-135m-instruct/cells/elsi-m1-seed0-claims
        [--target-runtime fp32] [--threads 2] [--per-category 4] [--k 2 3 4 5]

Part `e2e`: every contender on every prompt, interleaved prompt by prompt (the order rotated) so a
load change on a shared machine hits all alike, every one on the same target runtime:
  * greedy:            `greedy_generate`, the target alone on the loop `speculative_generate`
                       verifies with (the baseline: the ratio is the draft's contribution);
  * hf_greedy:         `model.generate(do_sample=False)` (transformers' own loop, same runtime);
  * prompt_lookup_<n>: `model.generate(prompt_lookup_num_tokens=n)`, transformers' prompt lookup;
  * eagle3_<dtype>_k<k>: `speculative_generate` with the native draft (fp32 / bf16 / int8).
Every output is checked equal to greedy's (exact verification); the count equal to the experiment's
recorded eager continuation is reported. Two rates: end to end (all new tokens / all seconds, the
prompt's prefill included) and decode (the tokens after the first / the seconds after the prefill,
the prefill timed on its own in the same rotation: a forward of the prompt on the same runtime),
which is what llama.cpp reports and what speculation changes.

Part `parts`: what one round costs, at these shapes, interleaved, medians: a target forward of 1 and
of k+1 tokens at the prompts' mean context, one native draft step per precision, and the torch
extend against a loop of native steps over n target positions (`speculative.NATIVE_EXTEND_MAX`).
  -> bench/results/spec_e2e_cpu.jsonl
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]

from bench.common import device_name, record
from elsi_fast.decoding.speculative import _crop, _TargetRunner, greedy_generate, speculative_generate
from elsi_fast.draft import native, read_draft

FILE = "spec_e2e_cpu"
DTYPES = ("fp32", "bf16", "int8")
EXPERIMENT = ROOT / "runs" / "draft-experiment" / "smollm2-135m-instruct"


def interleaved(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds of every call, round-robin over the contenders (the order rotated every round)."""
    for fn in fns.values():
        fn()
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            fns[name]()
            samples[name].append(time.perf_counter() - start)
    return samples


def chosen_prompts(experiment: Path, per_category: int) -> list[dict]:
    """The first `per_category` evaluation records of every Spec-Bench category (the prompts
    `bench/integration/llamacpp.py measure` serves), with the target's recorded continuation."""
    from elsi_fast.training.regenerate import read_conversations

    by_category: dict[str, list[dict]] = {}
    for r in read_conversations(experiment / "eval" / "conversations.jsonl"):
        by_category.setdefault(r["category"], []).append(r)
    return [r for group in by_category.values() for r in group[:per_category]]


def bench_e2e(args, model, tokenizer, draft, records: list[dict], dev: str, conditions: dict) -> None:
    from transformers import GenerationConfig

    eos, n_new = tokenizer.eos_token_id, args.new_tokens
    prompts = [torch.tensor([r["prompt_ids"]]) for r in records]
    max_len = max(p.shape[1] for p in prompts) + n_new + max(args.k) + 2
    decoders = {dtype: native.NativeDraftDecoder(draft, dtype, max_len=max_len) for dtype in args.dtypes}

    def hf(prompt: torch.Tensor, **options) -> list[int]:
        config = GenerationConfig(do_sample=False, max_new_tokens=n_new, eos_token_id=eos, pad_token_id=eos, **options)
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=config)
        return out[0, prompt.shape[1]:].tolist()

    contenders: dict[str, Callable[[torch.Tensor], object]] = {
        "greedy": lambda p: greedy_generate(model, p, n_new, eos_token_id=eos).tolist(),
        "hf_greedy": hf,
        **{f"prompt_lookup_{n}": (lambda p, n=n: hf(p, prompt_lookup_num_tokens=n)) for n in args.lookup},
        **{f"eagle3_{dtype}_k{k}": (lambda p, d=decoders[dtype], k=k: speculative_generate(model, d, p, n_new, k,
                                                                                             eos_token_id=eos))
           for dtype in args.dtypes for k in args.k},
    }
    names = list(contenders)
    seconds = {name: [] for name in names + ["prefill"]}

    def prefill(prompt: torch.Tensor) -> None:
        _TargetRunner(model, []).forward(prompt, last_only=True)  # every contender's first forward
    accepted = {name: [0, 0] for name in names}  # (accepted tokens, rounds) of the draft paths
    tokens, as_recorded = 0, 0
    for i, (prompt, rec) in enumerate(zip(prompts, records)):
        outputs = {}
        rotation = names + ["prefill"]
        for name in rotation[i % len(rotation):] + rotation[: i % len(rotation)]:
            start = time.perf_counter()
            out = prefill(prompt) if name == "prefill" else contenders[name](prompt)
            seconds[name].append(time.perf_counter() - start)
            if name == "prefill":
                continue
            outputs[name] = out if isinstance(out, list) else out.tokens.tolist()
            if not isinstance(out, list):
                accepted[name][0] += sum(out.accepted_lengths)
                accepted[name][1] += out.rounds
        reference = outputs["greedy"]
        differing = [name for name, ids in outputs.items() if ids != reference]
        if differing:
            raise SystemExit(f"{differing}: output differs from greedy decoding on prompt {rec['id']}")
        tokens += len(reference)
        as_recorded += reference == rec["response_ids"][:n_new]
        print(f"prompt {i + 1}/{len(prompts)} ({rec['category']}, {prompt.shape[1]} tokens): "
              f"{len(reference)} new, greedy {seconds['greedy'][-1]:.2f} s", flush=True)
    total = {name: sum(s) for name, s in seconds.items()}
    rate = {name: tokens / total[name] for name in names}
    decode = {name: (tokens - len(records)) / (total[name] - total["prefill"]) for name in names}
    params = dict(conditions, draft=str(args.draft), layers=list(draft.config.aux_layer_ids), prompts=len(records),
                  per_category=args.per_category, new_tokens_max=n_new, new_tokens=tokens, stops_at="end of turn",
                  outputs_equal_to_eager_record=as_recorded, prefill_seconds=total["prefill"])
    for name in names:
        per_prompt = [g / s for g, s in zip(seconds["greedy"], seconds[name])]
        extra = {}
        if accepted[name][1]:
            extra["tau"] = (accepted[name][0] + accepted[name][1]) / accepted[name][1]
        record(FILE, "spec_e2e_real_target", f"{name}_decode_tokens_per_s", decode[name], "tokens/s", device=dev,
               baseline=decode["greedy"], ratio=decode[name] / decode["greedy"],
               params={**params, **extra, "vs_hf_greedy": decode[name] / decode["hf_greedy"]})
        record(FILE, "spec_e2e_real_target", f"{name}_tokens_per_s", rate[name], "tokens/s", device=dev,
               baseline=rate["greedy"], ratio=rate[name] / rate["greedy"],
               params={**params, **extra, "median_per_prompt_speedup": statistics.median(per_prompt),
                       "vs_hf_greedy": rate[name] / rate["hf_greedy"]})
        tau = f", tau {extra['tau']:.2f}" if extra else ""
        print(f"{name:<20} decode {decode[name]:7.2f} tokens/s {decode[name] / decode['greedy']:.2f}x greedy; "
              f"end to end {rate[name]:7.2f} tokens/s {rate[name] / rate['greedy']:.2f}x{tau}")
    print(f"{as_recorded}/{len(records)} greedy outputs equal to the recorded eager continuation")


def bench_parts(args, model, draft, records: list[dict], dev: str, conditions: dict) -> None:
    context = round(statistics.mean(len(r["prompt_ids"]) for r in records)) + args.new_tokens // 2
    vocab = model.config.vocab_size
    runner = _TargetRunner(model, list(draft.config.aux_layer_ids))
    runner.forward(torch.randint(0, vocab, (1, context)))

    def target_forward(n: int) -> Callable[[], None]:
        ids = torch.randint(0, vocab, (1, n))

        def run() -> None:
            runner.forward(ids)
            _crop(runner.cache, context)
        return run

    width = draft.config.fc_in_features
    feedback = torch.randn(draft.config.hidden_size)
    decoders = {dtype: native.NativeDraftDecoder(draft, dtype, max_len=context + 64) for dtype in args.dtypes}

    def native_step(decoder) -> Callable[[], None]:
        def run() -> None:
            decoder.length = context
            decoder.step(feedback, 7, from_target=False)
        return run

    def native_extend(decoder, n: int) -> Callable[[], None]:
        rows = torch.randn(n, width)

        def run() -> None:  # as `speculative._NativeDraftPath.extend`: the last position drafts
            decoder.length = context
            for row in rows[:-1]:
                decoder.cache_position(row, 7)
            decoder.step(rows[-1], 7, from_target=True)
        return run

    cache = draft.new_cache(context + 64)

    def torch_extend(n: int) -> Callable[[], None]:
        rows, ids = torch.randn(1, n, width), torch.full((1, n), 7)

        def run() -> None:
            cache.length = context
            with torch.no_grad():
                draft.extend(rows, ids, cache)
        return run

    fns = {f"target_{n}": target_forward(n) for n in sorted({1, *(k + 1 for k in args.k)})}
    fns.update({f"draft_step_{dtype}": native_step(d) for dtype, d in decoders.items()})
    for n in sorted({1, 2, max(args.k) + 1, 16}):
        fns[f"extend{n}_torch"] = torch_extend(n)
        fns.update({f"extend{n}_native_{dtype}": native_extend(d, n) for dtype, d in decoders.items()})
    medians = {name: statistics.median(s) for name, s in interleaved(fns, args.rounds).items()}
    params = dict(conditions, context=context, rounds=args.rounds, layers=list(draft.config.aux_layer_ids))
    for name, value in medians.items():
        ratio = value / medians["target_1"] if name.startswith("target_") else None
        record(FILE, "spec_e2e_parts", f"{name}_ms", value * 1e3, "ms", device=dev,
               baseline=medians["target_1"] * 1e3 if ratio else None, ratio=ratio, params=params)
        print(f"{name:<24} {value * 1e3:8.3f} ms" + (f"  {ratio:.2f}x a 1-token forward" if ratio else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draft", type=Path, required=True, help="a trained draft folder (EAGLE3 format)")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--experiment", type=Path, default=EXPERIMENT,
                        help="the draft experiment's folder (its evaluation prompts and continuations)")
    parser.add_argument("--target-runtime", choices=("fp32", "bf16", "int8"), default="fp32")
    parser.add_argument("--part", choices=("e2e", "parts", "all"), default="all")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--per-category", type=int, default=4)
    parser.add_argument("--k", type=int, nargs="+", default=[2, 3, 4, 5])
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--lookup", type=int, nargs="+", default=[3, 10], help="prompt_lookup_num_tokens values")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds of the `parts` timings")
    args = parser.parse_args()
    from elsi_fast.targets.loading import load_model
    from elsi_fast.targets.target_runtime import accelerate

    torch.set_num_threads(args.threads)
    if not native.available("cpu"):
        raise SystemExit(f"no native op: {native.describe('cpu')}")
    model, tokenizer = load_model(args.target, device="cpu", dtype="float32")
    runtime = accelerate(model, args.target_runtime, threads=args.threads)
    draft = read_draft(str(args.draft), embed_tokens=model.get_input_embeddings().weight.detach()).eval()
    records = chosen_prompts(args.experiment, args.per_category)
    dev = device_name("cpu")
    conditions = dict(model=args.target, target_runtime=runtime.describe(), threads=args.threads,
                      native=native.describe("cpu"), loadavg=[round(x, 2) for x in os.getloadavg()])
    print(f"{dev}; {runtime.describe()}; {native.describe('cpu')}; load average {os.getloadavg()}")
    if args.part in ("parts", "all"):
        bench_parts(args, model, draft, records, dev, conditions)
    if args.part in ("e2e", "all"):
        bench_e2e(args, model, tokenizer, draft, records, dev, conditions)
    print(f"load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
