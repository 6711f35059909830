"""Does a kept draft copy? Its chain against prompt lookup on the same continuations, and on a repeated passage.

    python -m bench.draft_copy --model smollm2-135m-instruct --drafts bench/results/drafts/smollm2-135m-instruct/*
                               [--sets spec-bench held-out] [--n 3] [--k 4]

Greedy targets copy: a summary or a RAG answer repeats its prompt, and a small model repeats
itself. Prompt lookup (`decoding.prompt_lookup`, n-gram drafting without a draft) predicts those
tokens for free, so it is the yardstick a trained draft has to beat. On each evaluation set's fixed
greedy continuations (`bench.draft_long_run`'s sets and feature caches, replayed as
`decoding.evaluation.replay_runs_per_k` replays them) this measures, per chain start t, the draft's
leading matches L_draft(t) and the lookup's L_lookup(t), and reports at k:
  tau_k<k>/draft, tau_k<k>/prompt_lookup   each alone, pooled as `pooled_tau` pools
  tau_k<k>/lookup_then_draft               the lookup's proposal where it has one, else the draft's:
                                           what `eval-draft --prompt-lookup n` measures (the same
                                           rounds as `replay_runs_per_k(prompt_lookup=n)`)
  tau_k<k>/either                          max(L_draft, L_lookup): a ceiling for any rule that
                                           picks one of the two per round
  tau_k<k>/lookup_then_draft_up_to_<K>     with --lookup-k K: the lookup's rounds propose up to K
                                           tokens (`eval-draft --prompt-lookup n --lookup-k K`)
  first_token_acc/draft, first_token_acc/prompt_lookup, first_token_acc/draft_where_lookup_right:
                                           the share of chain starts whose first proposal is the
                                           target's token, and the draft's share where the
                                           lookup's is (a draft that copies is right there)
and a known answer: passages of the corpora (kept away from the evaluation prompts by
`InstructionFilter`), each fed twice in a row; the target's own greedy token on the second copy is
almost always the copy, and `repeat_agreement/draft` is the share of those positions where the
draft's first proposal equals the target's greedy token (`repeat_copy/target`: the share where the
target's greedy token is the copy).
  -> bench/results/draft_copy_cpu.jsonl (params: model, draft, layers, set, per_category)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import ROOT, device_name, record

RESULTS = "draft_copy_cpu"
CORPORA = ("wikitext2_valid.txt", "wikitext2_test.txt", "pride_and_prejudice.txt", "alice.txt",
           "tinystories_valid_part.txt")


def pooled(rounds_by_category: dict[str, list[list[int]]]) -> dict[str, float]:
    """tau per category and over all: (accepted + rounds) / rounds, as `pooled_tau`."""
    out, accepted, count = {}, 0, 0
    for category, runs in sorted(rounds_by_category.items()):
        a = sum(sum(r) for r in runs)
        n = sum(len(r) for r in runs)
        out[category] = (a + n) / n
        accepted, count = accepted + a, count + n
    out["all"] = (accepted + count) / count
    return out


def set_rows(draft, rows: list[dict], cache, layers: list[int], n: int, k: int,
             lookup_k: int | None = None) -> dict[str, dict[str, float]]:
    """metric -> category -> value for one evaluation set (see the module docstring)."""
    import torch

    from elsi_fast.decoding.evaluation import chain_matches, chain_rounds, continuation_samples
    from elsi_fast.decoding.prompt_lookup import lookup_matches

    samples = continuation_samples(rows)
    order = sorted((i for i in range(len(rows)) if len(rows[i]["response_ids"]) >= 2), key=lambda i: len(samples[i].ids))
    longer = () if lookup_k is None else (f"lookup_then_draft_up_to_{lookup_k}",)
    rounds = {name: {} for name in ("draft", "prompt_lookup", "lookup_then_draft", "either", *longer)}
    firsts = {}  # category -> [starts, draft right, lookup right, both right]
    with torch.inference_mode():
        for start in range(0, len(order), 16):
            chunk = order[start : start + 16]
            for i, by_draft in zip(chunk, chain_matches(draft, [rows[i] for i in chunk], samples, chunk, cache, layers, k)):
                record_, ids = rows[i], samples[i].ids.tolist()
                first = len(record_["prompt_ids"]) - 1
                by_lookup, found = lookup_matches(ids, first, n, max(k, lookup_k or 0))
                if longer:
                    combined = [b if f else a for a, b, f in zip(by_draft, by_lookup, found)]
                    caps = [lookup_k if f else k for f in found]
                    rounds[longer[0]].setdefault(record_.get("category") or "text", []).append(
                        chain_rounds(combined, record_, k, caps))
                by_lookup = [min(b, k) for b in by_lookup]  # the k-token lookup of the other columns
                either = [max(a, b) for a, b in zip(by_draft, by_lookup)]
                combined = [b if f else a for a, b, f in zip(by_draft, by_lookup, found)]
                category = record_.get("category") or "text"
                for name, matches in (("draft", by_draft), ("prompt_lookup", by_lookup), ("lookup_then_draft", combined),
                                      ("either", either)):
                    rounds[name].setdefault(category, []).append(chain_rounds(matches, record_, k))
                tally = firsts.setdefault(category, [0, 0, 0, 0])
                for t in range(first, len(ids) - 2):
                    d, g = by_draft[t] >= 1, by_lookup[t] >= 1
                    tally[0] += 1
                    tally[1] += d
                    tally[2] += g
                    tally[3] += d and g
    out = {f"tau_k{k}/{name}": pooled(by_category) for name, by_category in rounds.items()}
    firsts["all"] = [sum(t[j] for t in firsts.values()) for j in range(4)]
    out["first_token_acc/draft"] = {c: t[1] / t[0] for c, t in firsts.items()}
    out["first_token_acc/prompt_lookup"] = {c: t[2] / t[0] for c, t in firsts.items()}
    out["first_token_acc/draft_where_lookup_right"] = {c: t[3] / t[2] for c, t in firsts.items() if t[2]}
    return out


def repeated_passages(tokenizer, count: int, tokens: int, seed: int = 0) -> list[list[int]]:
    """`count` corpus passages of `tokens` tokens each (eval-filtered), in a seeded order."""
    import random

    from bench.common import shared_data
    from elsi_fast.training.corpus_tasks import passages
    from elsi_fast.training.self_instruct import InstructionFilter, evaluation_texts

    keep = InstructionFilter(evaluation_texts([str(shared_data("prompts", f)) for f in
                                               ("spec_bench_question.jsonl", "mt_bench_question.jsonl")]))
    pool = [p for name in CORPORA for p, _ in passages(shared_data("corpus", name))]
    random.Random(seed).shuffle(pool)
    out = []
    for text in pool:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens and keep.add(text) is None:
            out.append(ids[:tokens])
            if len(out) == count:
                break
    return out


def repeat_rows(draft, model, layers: list[int], passages: list[list[int]]) -> dict[str, float]:
    """repeat_agreement/draft and repeat_copy/target over the second copies (see the docstring)."""
    import torch

    from elsi_fast.targets.capture import capture_hidden_states

    agree = copy = positions = 0
    with torch.inference_mode():
        for passage in passages:
            seq = torch.tensor([passage + passage])
            with capture_hidden_states(model, layers) as captured:
                greedy = model(seq).logits[0].argmax(-1)  # at t: the target's token t + 1
            aux = torch.cat([captured.states[l] for l in layers], dim=-1)
            step0 = draft.ttt_forward(aux[:, :-1].to(draft.fc.weight.dtype), seq[:, 1:], 1)[0][0]
            proposed = draft.draft_to_target(step0.argmax(-1))  # at t: token t + 2
            half = len(passage)
            # chain starts inside the second copy whose 3 tokens of context are already a copy
            for t in range(half + 2, 2 * half - 2):
                positions += 1
                agree += int(proposed[t] == greedy[t + 1])
                copy += int(greedy[t + 1] == seq[0, t + 2])
    return {"repeat_agreement/draft": agree / positions, "repeat_copy/target": copy / positions, "positions": positions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--data", default=str(ROOT / "runs" / "data-smollm2"), help="the long run's data folder")
    parser.add_argument("--drafts", nargs="+", required=True, metavar="DIR", help="draft folders of --model")
    parser.add_argument("--sets", nargs="+", default=["spec-bench"], choices=("spec-bench", "held-out"))
    parser.add_argument("--n", type=int, default=3, help="prompt lookup's n-gram length")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--lookup-k", type=int, default=None, metavar="K",
                        help="also the lookup's rounds proposing up to K tokens, the draft's k")
    parser.add_argument("--passages", type=int, default=16, help="repeated passages (0: none)")
    parser.add_argument("--passage-tokens", type=int, default=96)
    parser.add_argument("--note", default="", help="conditions to record in the rows")
    args = parser.parse_args()
    for name in ("n", "k", "passage_tokens", *(("lookup_k",) if args.lookup_k is not None else ())):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: expected a positive int, got {getattr(args, name)}")
    if args.passages < 0:
        raise SystemExit(f"--passages: expected a count >= 0, got {args.passages}")

    from bench.draft_long_run import KEEP, _spec_bench, held_sets, opening_batch_ids
    from elsi_fast.decoding.evaluation import continuation_samples
    from elsi_fast.draft.formats import read_draft
    from elsi_fast.targets.loading import load_model
    from elsi_fast.training.feature_cache import build
    from elsi_fast.training.regenerate import CONVERSATIONS_FILE, read_conversations

    model, tokenizer = load_model(args.model, device="cpu", dtype="float32", argument="--model",
                                  device_argument="--device", progress=False)
    work = ROOT / "runs" / "long-run" / args.model
    keep = KEEP / args.model
    sets = {}
    for name in args.sets:
        if name == "spec-bench":
            sets[name] = _spec_bench(model, tokenizer, work, keep)
        else:
            records = read_conversations(Path(args.data) / CONVERSATIONS_FILE)
            sets[name] = held_sets(records, keep, 0, opening_batch_ids(records, Path(args.data)))[2]
    passages = repeated_passages(tokenizer, args.passages, args.passage_tokens) if args.passages else []
    embed = model.get_input_embeddings().weight.detach()
    device = device_name("cpu")
    for folder in args.drafts:
        kept = Path(folder) / "training.json"
        facts = json.loads(kept.read_text()) if kept.is_file() else {}
        draft = read_draft(folder, embed).eval()
        layers = list(draft.config.aux_layer_ids)
        common = {"model": args.model, "draft": str(Path(folder).resolve().relative_to(ROOT)) if Path(folder).resolve()
                  .is_relative_to(ROOT) else folder, "layers": layers, "tokens_seen": facts.get("tokens_seen"),
                  "n": args.n, "k": args.k, "note": args.note,
                  **({} if args.lookup_k is None else {"lookup_k": args.lookup_k})}
        for name, rows in sets.items():
            cache = build(model, continuation_samples(rows), layers, work / f"cache-{name}-{'-'.join(map(str, layers))}",
                          dtype="bfloat16", progress=False)
            for metric, by_category in set_rows(draft, rows, cache, layers, args.n, args.k, args.lookup_k).items():
                unit = "tokens/forward" if metric.startswith("tau") else "fraction"
                record(RESULTS, "draft_copy", metric, by_category["all"], unit, device=device,
                       params={**common, "set": name, "prompts": len(rows), "per_category": by_category})
                print(f"{folder} {name} {metric}: {by_category['all']:.3f}")
        if passages:
            result = repeat_rows(draft, model, layers, passages)
            for metric in ("repeat_agreement/draft", "repeat_copy/target"):
                record(RESULTS, "draft_copy", metric, result[metric], "fraction", device=device,
                       params={**common, "set": "repeated-passages", "passages": len(passages),
                               "passage_tokens": args.passage_tokens, "positions": result["positions"]})
                print(f"{folder} repeated passages {metric}: {result[metric]:.3f}")


if __name__ == "__main__":
    main()
