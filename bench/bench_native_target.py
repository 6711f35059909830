"""Greedy decoding speed of the native GGUF forward against llama.cpp on the same file.

Contenders, on each GGUF file and thread count, interleaved round by round (each round runs every
contender once; medians over --rounds):
  llama.cpp   llama-bench's tg test (-p 0 -n --tokens -r 1: a fresh context, --tokens one-token
              decodes), its tokens/s;
  native      `elsi_fast.targets.native_forward.NativeForward`: one BOS token, then --tokens greedy
              one-token forwards (`NativeForward.forward_greedy`: the row's argmax in C++), wall time.
  native+draft  the kept SmolLM2 ELSI m=1 draft (--draft) at each --k and weight precision
              (--draft-dtypes) with the target on the native forward
              (`decoding.native_target.native_speculative_generate`, native draft steps on the
              target's threads, each decoder built once) on --prompts chat instructions, --tokens new
              tokens each; its tokens are checked equal to the native greedy tokens of the same
              prompt, timed in the same round; with --prompt-lookup N also with the n-gram lookup
              proposing before the draft (`speculative_loop(prompt_lookup=N)`), k tokens a round
              and, with --lookup-k K, up to K. Each round also times each prompt's prefill alone
              (the greedy decoder's, `NativeTargetRunner.forward` of the prompt), so that the rows
              also give decode-only speeds: new tokens over the time less that prefill, for greedy
              and every case alike (params `*_decode_tokens_per_s`).
Files: the SmolLM2 package's Q4_1 file and its Q8_0 re-rounding (`gguf_requantize`, written once
into the cache); with --model gemma3-270m the Gemma 3 package's Q4_K_M file (type Q4_K_M in the
rows), without draft rows unless --draft names a draft trained for it. Also the native forward's
verify cost: a 5-token forward (k = 4 drafted tokens) against a 1-token forward at --context
positions, each rolled back; the samples keep T = 1..5 and 8 with all rows' logits and with none
(`forward_ms`: "all" and "body", the head's share being the difference; T = 8, the most rows a
native forward takes, is the verify of 7 prompt-lookup tokens).
  -> bench/results/native_target_cpu.jsonl, benchmark native_target_decode:
     greedy_tokens_per_s/<type>/threads=<t>  native; baseline llama.cpp's greedy at the same
                                             threads (ratio = native / llama.cpp; TARGET >= 1.0)
     verify_cost/<type>/threads=<t>/T=<T>    t(T tokens) / t(1 token) of the native forward, T = 5, 8
     draft_tokens_per_s/<type>/threads=<t>/k=<k>
                                             native+draft, params.draft_dtype; baseline llama.cpp's
                                             greedy (TARGET >= 1.5); .../lookup=<n> with prompt
                                             lookup (params.prompt_lookup); .../lookup=<n>/lookup_k=<K>
                                             its rounds proposing up to K (params.lookup_k)
Every row holds all samples and the load average: on a shared machine only rows from quiet cores
are a verdict (--no-record for a smoke run).

Run from the repository root:
`python -m bench.bench_native_target [--model gemma3-270m] [--rounds 5] [--tokens 128] [--threads 1 2]`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from bench.common import cpu_model, record
from bench.integration.llamacpp import VERSION, binary, llamacpp_amx
from elsi_fast._infra.cache import cache_root
from elsi_fast.targets import catalog
from elsi_fast.targets.gguf_requantize import requantize_gguf
from elsi_fast.decoding.native_target import (NativeTargetRunner, native_draft_decoder, native_greedy_generate,
                                              native_speculative_generate, target_embedding)
from elsi_fast.targets.native_forward import NativeForward

RESULTS_FILE = "native_target_cpu"
BENCHMARK = "native_target_decode"
TARGET = "smollm2-135m-instruct"
# Each model's package file type (the others are re-rounded from it).
PACKAGE_TYPES = {TARGET: "Q4_1", "gemma3-270m": "Q4_K_M"}
DRAFT = Path(__file__).resolve().parent / "results" / "drafts" / TARGET / "elsi-m1-11"
# Chat instructions of several kinds (none from Spec-Bench or MT-bench).
INSTRUCTIONS = (
    "Write a short story about a robot who learns to paint.",
    "Explain how a refrigerator keeps food cold.",
    "Give me three tips for writing a clear email to a colleague.",
    "What is the difference between weather and climate?",
)


def gguf_files(types: list[str], model: str = TARGET) -> dict[str, Path]:
    """The package's file, and the other types re-rounded from it into the cache (once)."""
    source = catalog.resolve(model)
    files = {}
    for kind in types:
        if kind == PACKAGE_TYPES[model]:
            files[kind] = source
            continue
        if model != TARGET:
            raise ValueError(f"--types: {model} runs its package's {PACKAGE_TYPES[model]} file only")
        path = cache_root() / "models" / source.name.replace("Q4_1", kind)
        files[kind] = path if path.is_file() else requantize_gguf(source, path, kind)
    return files


def llamacpp_greedy(path: Path, tokens: int, threads: int) -> tuple[float, dict]:
    cmd = [str(binary("llama-bench")), "-m", str(path), "-t", str(threads), "-p", "0", "-n", str(tokens),
           "-r", "1", "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        raise RuntimeError(f"llama-bench failed (exit {done.returncode}): {last}")
    row = json.loads(done.stdout)[0]
    return float(row["avg_ts"]), {"build_commit": row.get("build_commit"), "build_number": row.get("build_number")}


@functools.lru_cache
def bos_token(path: Path) -> int:
    import gguf

    return int(gguf.GGUFReader(str(path), "r").fields["tokenizer.ggml.bos_token_id"].contents())


def native_greedy(model: NativeForward, tokens: int) -> float:
    model.reset()
    token = int(model.forward_greedy([bos_token(model.weights.path)])[0][0])
    start = time.perf_counter()
    for _ in range(tokens):
        token = int(model.forward_greedy([token])[0][0])
    return tokens / (time.perf_counter() - start)


def native_forward_costs(model: NativeForward, context: int, reps: int) -> dict[str, dict[int, float]]:
    """Median ms of a T-token forward at `context` positions for T = 1..5 and 8 (MAX_ROWS: a batched
    generation step, or the verify of 7 prompt-lookup tokens): "all" with every row's logits (a
    verify), "body" with none (the blocks alone; the difference is the head's rows)."""
    model.reset()
    model.prefill(np.arange(context) % 1000 + 100)
    times: dict[str, dict[int, list[float]]] = {"all": {}, "body": {}}
    for _ in range(reps):
        for t in (1, 2, 3, 4, 5, 8):
            for part, rows in (("all", None), ("body", [])):
                start = time.perf_counter()
                model.forward(np.arange(t) + 200, rows)
                times[part].setdefault(t, []).append(1000 * (time.perf_counter() - start))
                model.rollback(context)
    return {part: {t: statistics.median(v) for t, v in by_t.items()} for part, by_t in times.items()}


def spec_bench_prompts(path: Path, per_category: int, max_tokens: int = 512) -> list[list[int]]:
    """`per_category` Spec-Bench prompts of each category, as `eval-draft` encodes them (chat
    template where the file has one, cut to their last `max_tokens` tokens)."""
    from bench.common import shared_data
    from elsi_fast.analysis.prompts import load_prompts, prompts_by_category
    from elsi_fast.targets.loading import gguf_tokenizer

    prompts = load_prompts(str(shared_data("prompts", "spec_bench_question.jsonl")))
    grouped = prompts_by_category(prompts, gguf_tokenizer(path), per_category, max_tokens)
    return [ids for ids_of_category in grouped.values() for ids in ids_of_category]


def chat_prompts(path: Path, count: int) -> list[list[int]]:
    """The instructions in the file's chat template; as plain text where it has none (Gemma 3's base
    model, whose draft trained on plain-text instructions)."""
    from elsi_fast.targets.loading import gguf_tokenizer

    tokenizer = gguf_tokenizer(path)
    if not tokenizer.chat_template:
        return [list(tokenizer(text).input_ids) for text in INSTRUCTIONS[:count]]
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               return_dict=True)["input_ids"]) for text in INSTRUCTIONS[:count]]


def case_name(dtype: str, k: int, lookup: int | None, lookup_k: int | None = None) -> str:
    return f"{dtype}_k={k}" + ("" if lookup is None else f"_lookup={lookup}") + \
        ("" if lookup_k is None else f"_lookup_k={lookup_k}")


def native_draft_round(model: NativeForward, decoders: dict[str, object], prompts: list[list[int]], tokens: int,
                       cases: list[tuple[str, int, int | None, int | None]]) -> dict:
    """Seconds of native greedy and native+draft for each case (decoder weight dtype, k, prompt
    lookup's n or None, its proposals' length or None for k) over the prompts, and of the prompts'
    prefill alone; new tokens; tau; equality."""
    import torch

    out: dict = {"greedy_s": 0.0, "prefill_s": 0.0, "cases": {c: {"s": 0.0, "accepted": 0, "rounds": 0} for c in cases},
                 "equal": True, "new_tokens": 0}
    for ids in prompts:
        start = time.perf_counter()
        NativeTargetRunner(model, []).forward(torch.tensor([ids]), last_only=True)
        out["prefill_s"] += time.perf_counter() - start
        start = time.perf_counter()
        greedy = native_greedy_generate(model, torch.tensor(ids), tokens)
        out["greedy_s"] += time.perf_counter() - start
        out["new_tokens"] += len(greedy)
        for dtype, k, lookup, lookup_k in cases:
            start = time.perf_counter()
            spec = native_speculative_generate(model, decoders[dtype], torch.tensor(ids), tokens, k,
                                               prompt_lookup=lookup, lookup_k=lookup_k)
            case = out["cases"][(dtype, k, lookup, lookup_k)]
            case["s"] += time.perf_counter() - start
            case["accepted"] += sum(spec.accepted_lengths)
            case["rounds"] += spec.rounds
            out["equal"] &= bool(torch.equal(spec.tokens, greedy))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=TARGET, choices=list(PACKAGE_TYPES))
    parser.add_argument("--types", nargs="+", default=None, choices=["Q4_0", "Q4_1", "Q8_0", "Q4_K_M"],
                        help="GGUF files (default: SmolLM2 Q4_1 and Q8_0; Gemma 3 its Q4_K_M)")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--context", type=int, default=128, help="KV positions of the verify-cost forwards")
    parser.add_argument("--k", nargs="*", type=int, default=None,
                        help="draft lengths (none: no draft rows; default 1 2 3 with SmolLM2's kept draft)")
    parser.add_argument("--prompts", type=int, default=4, help=f"chat instructions (at most {len(INSTRUCTIONS)})")
    parser.add_argument("--spec-bench", type=int, default=None, metavar="N",
                        help="time the drafts on N Spec-Bench prompts of each of its 13 categories (cut to their "
                        "last 512 tokens) instead of the chat instructions")
    parser.add_argument("--draft", type=Path, default=None, help="a draft for --model (default: SmolLM2's kept one)")
    parser.add_argument("--draft-dtypes", nargs="+", default=["bf16", "int8"], choices=["fp32", "bf16", "int8"],
                        help="the native draft's weight precisions, each a row (default bf16 int8)")
    parser.add_argument("--prompt-lookup", nargs="+", type=int, default=[], metavar="N",
                        help="also time each draft case with the n-gram lookup of each N proposing first")
    parser.add_argument("--lookup-k", nargs="+", type=int, default=[], metavar="K",
                        help="also time each lookup case with its rounds proposing up to each K tokens")
    parser.add_argument("--no-record", action="store_true", help="print only (a smoke run)")
    parser.add_argument("--note", default="", help="conditions to keep in the rows (e.g. background jobs paused)")
    args = parser.parse_args(argv)
    if args.types is None:
        args.types = ["Q4_1", "Q8_0"] if args.model == TARGET else [PACKAGE_TYPES[args.model]]
    if args.draft is None and args.model == TARGET:
        args.draft = DRAFT
    if args.k is None:
        args.k = [1, 2, 3] if args.draft is not None else []
    if args.k and args.draft is None:
        parser.error(f"--k: {args.model} has no kept draft; name one with --draft")

    files = gguf_files(args.types, args.model)
    load_before = os.getloadavg()
    samples: dict[tuple[str, int], dict[str, list[float]]] = {}
    if args.spec_bench is not None and args.spec_bench < 1:
        parser.error(f"--spec-bench: expected a count >= 1, got {args.spec_bench}")
    prompts = [] if not args.k else (chat_prompts(files[args.types[0]], args.prompts) if args.spec_bench is None
                                     else spec_bench_prompts(files[args.types[0]], args.spec_bench))
    capacity = max([args.tokens, args.context, *(len(p) + args.tokens + max(args.k) + 1 for p in prompts)]) + 8
    models = {(k, t): NativeForward(p, capacity=capacity, num_threads=t)
              for k, p in files.items() for t in args.threads}
    # One decoder per target, precision and thread count, built before the rounds (a decoder per
    # prompt would time its packing and, without the target's team, a free-core probe).
    decoders: dict[tuple[str, int], dict[str, object]] = {}
    if args.k:
        from elsi_fast.draft import read_draft

        for kind in files:
            embed = target_embedding(next(m for (k, _), m in models.items() if k == kind))
            draft = read_draft(args.draft, embed_tokens=embed)
            for (k, threads), model in models.items():
                if k == kind:
                    decoders[(kind, threads)] = {d: native_draft_decoder(model, draft, d) for d in args.draft_dtypes}
    if any(n < 1 for n in args.prompt_lookup):
        parser.error(f"--prompt-lookup: expected n-gram lengths >= 1, got {args.prompt_lookup}")
    if any(k < 1 for k in args.lookup_k) or (args.lookup_k and not args.prompt_lookup):
        parser.error(f"--lookup-k: expected lengths >= 1 with --prompt-lookup, got {args.lookup_k}")
    cases = [(dtype, k, None, None) for dtype in args.draft_dtypes for k in args.k] + \
        [(dtype, k, n, lookup_k) for dtype in args.draft_dtypes for k in args.k for n in args.prompt_lookup
         for lookup_k in [None, *args.lookup_k]]
    build: dict = {}
    for r in range(args.rounds):
        for (kind, threads), model in models.items():
            s = samples.setdefault((kind, threads), {"llama.cpp": [], "native": [], "t1_ms": [], "t5_ms": [],
                                                     "chat_greedy": [], **{f"draft_{case_name(*c)}": [] for c in cases},
                                                     "tau": {case_name(*c): [0, 0] for c in cases}, "equal": True})
            ts, build = llamacpp_greedy(files[kind], args.tokens, threads)
            s["llama.cpp"].append(ts)
            s["native"].append(native_greedy(model, args.tokens))
            costs = native_forward_costs(model, args.context, reps=5)
            t1, t5 = costs["all"][1], costs["all"][5]
            s["t1_ms"].append(t1)
            s["t5_ms"].append(t5)
            s.setdefault("forward_ms", []).append(costs)
            if args.k:
                d = native_draft_round(model, decoders[(kind, threads)], prompts, args.tokens, cases)
                s["chat_greedy"].append(d["new_tokens"] / d["greedy_s"])
                s.setdefault("chat_greedy_decode", []).append(d["new_tokens"] / (d["greedy_s"] - d["prefill_s"]))
                for c, case in d["cases"].items():
                    s[f"draft_{case_name(*c)}"].append(d["new_tokens"] / case["s"])
                    s.setdefault(f"decode_{case_name(*c)}", []).append(d["new_tokens"] / (case["s"] - d["prefill_s"]))
                    s["tau"][case_name(*c)][0] += case["accepted"] + case["rounds"]
                    s["tau"][case_name(*c)][1] += case["rounds"]
                s["equal"] &= d["equal"]
                print("  native greedy on the prompts {:.1f} tokens/s; with the draft {} (tokens equal: {})".format(
                    s["chat_greedy"][-1], ", ".join(f"{case_name(*c)} {s[f'draft_{case_name(*c)}'][-1]:.1f}"
                                                    for c in cases), d["equal"]), flush=True)
            print(f"round {r + 1} {kind} {threads} threads: llama.cpp {ts:.1f}, native {s['native'][-1]:.1f} "
                  f"tokens/s; native verify 5 tokens {t5 / t1:.2f}x", flush=True)
    load = {"before": load_before, "after": os.getloadavg()}
    baseline_name = (f"llama.cpp {VERSION} (llama-cpp-python sdist; build {build.get('build_number')} "
                     f"{build.get('build_commit')}) llama-bench tg")
    for (kind, threads), s in samples.items():
        ours, theirs = statistics.median(s["native"]), statistics.median(s["llama.cpp"])
        cost = statistics.median(s["t5_ms"]) / statistics.median(s["t1_ms"])
        print(f"{kind} threads={threads}: native {ours:.1f} tokens/s, llama.cpp {theirs:.1f} ({ours / theirs:.2f}x); "
              f"verify T=5 costs {cost:.2f}x T=1", flush=True)
        for c in cases:
            value = statistics.median(s[f"draft_{case_name(*c)}"])
            tau = s["tau"][case_name(*c)]
            decode, greedy_decode = (statistics.median(s[key]) for key in (f"decode_{case_name(*c)}", "chat_greedy_decode"))
            print(f"  with the draft {case_name(*c)}: {value:.1f} tokens/s ({value / theirs:.2f}x llama.cpp's "
                  f"greedy, {value / statistics.median(s['chat_greedy']):.2f}x native greedy; decode only "
                  f"{decode / greedy_decode:.2f}x), tau {tau[0] / tau[1]:.3f}, tokens equal to native greedy: "
                  f"{s['equal']}", flush=True)
        if args.no_record:
            continue
        device = f"{cpu_model()} ({threads} threads)"
        params = {"model": args.model, "file": files[kind].name, "type": kind, "threads": threads,
                  "tokens": args.tokens,
                  "rounds": args.rounds, "samples": s, "loadavg": load, "baseline": baseline_name,
                  "llamacpp_amx": llamacpp_amx(), "note": args.note}
        record(RESULTS_FILE, BENCHMARK, f"greedy_tokens_per_s/{kind}/threads={threads}", ours, "tokens/s",
               device=device, baseline=theirs, ratio=ours / theirs, params=params)
        record(RESULTS_FILE, BENCHMARK, f"verify_cost/{kind}/threads={threads}/T=5", cost, "x", device=device,
               baseline=statistics.median(s["t1_ms"]), ratio=cost, params={**params, "context": args.context})
        # T = 8: the verify of 7 prompt-lookup tokens, the most rows one native forward takes
        longer = statistics.median(c["all"][8] for c in s["forward_ms"]) / statistics.median(s["t1_ms"])
        record(RESULTS_FILE, BENCHMARK, f"verify_cost/{kind}/threads={threads}/T=8", longer, "x", device=device,
               baseline=statistics.median(s["t1_ms"]), ratio=longer, params={**params, "context": args.context})
        for dtype, k, lookup, lookup_k in cases:
            name = case_name(dtype, k, lookup, lookup_k)
            value = statistics.median(s[f"draft_{name}"])
            tau = s["tau"][name][0] / s["tau"][name][1]
            record(RESULTS_FILE, BENCHMARK, f"draft_tokens_per_s/{kind}/threads={threads}/k={k}"
                   + ("" if lookup is None else f"/lookup={lookup}")
                   + ("" if lookup_k is None else f"/lookup_k={lookup_k}"), value, "tokens/s",
                   device=device, baseline=theirs, ratio=value / theirs,
                   params={**params, "draft": str(args.draft.name), "draft_dtype": dtype, "k": k, "tau": tau,
                           **({} if lookup is None else {"prompt_lookup": lookup}),
                           **({} if lookup_k is None else {"lookup_k": lookup_k}),
                           "prompts": len(prompts),
                           "prompt_set": "chat" if args.spec_bench is None else f"spec-bench x{args.spec_bench}",
                           "native_chat_greedy_tokens_per_s": statistics.median(s["chat_greedy"]),
                           "native_chat_greedy_decode_tokens_per_s": statistics.median(s["chat_greedy_decode"]),
                           "decode_tokens_per_s": statistics.median(s[f"decode_{name}"]),
                           "tokens_equal_native_greedy": s["equal"]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
