"""`elsi-fast train-draft` and `elsi-fast eval-draft`: train an EAGLE3 draft on chosen layers, measure tau."""

from __future__ import annotations

import argparse
import json
import os


def register(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser(
        "train-draft",
        help="train an EAGLE3 draft head on chosen target layers (EAGLE3 checkpoint format)",
        description="Train an EAGLE3 draft reading the target's hidden states at --layers (input-to-layer ids), "
        "or at the layers a report.json selects with --method/--m. The target runs online; the run resumes "
        "from OUT/training_state.pt unless --no-resume.",
    )
    train.add_argument("--target", required=True, help="target model folder or hub id")
    which = train.add_mutually_exclusive_group(required=True)
    which.add_argument("--layers", type=int, nargs="+", help="input-to-layer ids, e.g. 2 6 9")
    which.add_argument("--report", help="report.json from `elsi-fast analyze`; with --method and --m")
    train.add_argument("--method", default="elsi", help="selection method in the report (default elsi)")
    train.add_argument("--m", type=int, default=1, help="number of layers for --report (default 1)")
    train.add_argument("--data", required=True, help="training text: a text file, a folder of .txt, or prompts JSONL")
    train.add_argument("--out", required=True, help="output folder (EAGLE3 checkpoint + training state)")
    train.add_argument("--steps", type=int, default=200)
    train.add_argument("--batch-size", type=int, default=8)
    train.add_argument("--seq-len", type=int, default=128)
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--warmup", type=int, default=20)
    train.add_argument("--ttt-steps", type=int, default=3, help="training-time-test depth (EAGLE3: 7)")
    train.add_argument("--draft-vocab-size", type=int, default=None, help="default: min(vocab, 1024)")
    train.add_argument("--intermediate-size", type=int, default=None, help="draft MLP width (default: the target's)")
    train.add_argument("--save-every", type=int, default=50)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    train.add_argument("--no-resume", action="store_true", help="start over even if OUT holds a training state")
    train.add_argument("--no-progress", action="store_true")
    train.set_defaults(func=train_handler)

    evaluate = subparsers.add_parser(
        "eval-draft",
        help="mean acceptance length tau of a draft per prompt category (greedy speculative decoding)",
        description="Speculative decoding of each prompt with the target and the draft; prints tau "
        "(tokens per target forward) per category and over all prompts.",
    )
    evaluate.add_argument("--target", required=True, help="target model folder or hub id")
    evaluate.add_argument("--draft", required=True, help="EAGLE3 draft folder (config.json + model.safetensors)")
    evaluate.add_argument("--prompts", required=True, help="JSONL with 'category' (Spec-Bench), text file, or folder")
    evaluate.add_argument("--k", type=int, default=4, help="draft tokens per round (default 4)")
    evaluate.add_argument("--max-new-tokens", type=int, default=48)
    evaluate.add_argument("--max-prompts", type=int, default=None, help="prompts per category (default: all)")
    evaluate.add_argument("--max-prompt-tokens", type=int, default=256, help="truncate prompts to this many tokens")
    evaluate.add_argument("--device", default=None)
    evaluate.add_argument("--draft-dtype", choices=("fp32", "bf16", "int8"), default=None,
                          help="native draft weights (int8/bf16 for memory-bound CPUs); an explicit value must "
                          "run natively (default: the draft's own precision, torch with a warning if not native)")
    evaluate.add_argument("--draft-backend", choices=("auto", "native", "torch"), default="auto",
                          help="draft decode path (default auto: native when it can run)")
    evaluate.add_argument("--json", default=None, help="also write the result to this JSON file")
    evaluate.add_argument("--no-progress", action="store_true")
    evaluate.set_defaults(func=eval_handler)


def _layers_from_args(args: argparse.Namespace) -> list[int]:
    if args.layers is not None:
        return list(args.layers)
    from ..report import LayerReport

    if not os.path.isfile(args.report):
        raise FileNotFoundError(f"--report: no such file: {args.report}")
    return LayerReport.from_json(args.report).select(args.method, args.m)


def train_handler(args: argparse.Namespace) -> int:
    from ..prompts import load_prompts
    from ..train import train_draft
    from .analyze import load_model

    layers = _layers_from_args(args)
    model, tokenizer = load_model(args.target, args.device, "float32")
    texts = [prompt.text for prompt in load_prompts(args.data)]
    overrides = {} if args.intermediate_size is None else {"intermediate_size": args.intermediate_size}
    draft = train_draft(
        model, tokenizer, layers, texts, out_dir=args.out, draft_config=overrides,
        draft_vocab_size=args.draft_vocab_size, steps=args.steps, batch_size=args.batch_size,
        seq_len=args.seq_len, lr=args.lr, warmup=args.warmup, ttt_steps=args.ttt_steps, seed=args.seed,
        save_every=args.save_every, resume=not args.no_resume, progress=not args.no_progress,
    )
    with open(os.path.join(args.out, "train_summary.json")) as f:
        loss = json.load(f)["final_loss"]
    print(f"trained draft on layers {list(draft.config.aux_layer_ids)} (input-to-layer): "
          f"final loss {loss:.4f}; EAGLE3 checkpoint in {args.out}")
    return 0


def prompts_by_category(path: str, tokenizer, max_prompts: int | None, max_tokens: int) -> dict[str, list[list[int]]]:
    """Token ids of the prompts in `path`, grouped by their category ("text" when none)."""
    from ..prompts import encode_prompt, load_prompts

    if max_prompts is not None and max_prompts < 1:
        raise ValueError(f"--max-prompts: must be >= 1, got {max_prompts}")
    grouped: dict[str, list[list[int]]] = {}
    for prompt in load_prompts(path):
        ids = encode_prompt(prompt, tokenizer)[:max_tokens]
        bucket = grouped.setdefault(prompt.category or "text", [])
        if max_prompts is None or len(bucket) < max_prompts:
            bucket.append(ids)
    return grouped


def eval_handler(args: argparse.Namespace) -> int:
    from ..draft import Eagle3Draft
    from ..train import pooled_tau, speculative_runs
    from .analyze import load_model

    model, tokenizer = load_model(args.target, args.device, "float32")
    if not os.path.isdir(args.draft):
        raise FileNotFoundError(f"--draft: no such folder: {args.draft}")
    draft = Eagle3Draft.from_pretrained(args.draft, embed_tokens=model.get_input_embeddings().weight.detach(),
                                        device=model.device).eval()
    grouped = prompts_by_category(args.prompts, tokenizer, args.max_prompts, args.max_prompt_tokens)
    runs = speculative_runs(model, draft, grouped, k=args.k, max_new_tokens=args.max_new_tokens,
                            draft_dtype=args.draft_dtype, draft_backend=args.draft_backend,
                            progress=not args.no_progress)
    taus = pooled_tau(runs)
    results = [result for per_prompt in runs.values() for result in per_prompt]
    draft_calls = {key: sum(r.draft_calls.get(key, 0) for r in results) for key in results[0].draft_calls}
    backend = results[0].draft_backend.split(":")[0]
    print(f"draft layers {list(draft.config.aux_layer_ids)}, k={args.k}, {args.max_new_tokens} new tokens per prompt")
    print(f"draft backend: {backend}; calls over all prompts: "
          + ", ".join(f"{key} {count}" for key, count in draft_calls.items()))
    print(f"{'category':<24} {'prompts':>7} {'tau':>6}")
    for category, tau in taus.items():
        count = sum(map(len, grouped.values())) if category == "all" else len(grouped[category])
        print(f"{category:<24} {count:>7} {tau:>6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"draft": args.draft, "layers": list(draft.config.aux_layer_ids), "k": args.k,
                       "max_new_tokens": args.max_new_tokens, "tau": taus, "draft_backend": backend,
                       "draft_calls": draft_calls}, f, indent=1)
    return 0
