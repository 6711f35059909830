"""`elsi-fast train-draft` and `elsi-fast eval-draft`: train an EAGLE3 draft on chosen layers, measure tau."""

from __future__ import annotations

import argparse
import json
import math
import os

from .._infra.native_names import DRAFT_BACKENDS, NATIVE_WEIGHT_DTYPES, TRAINING_PRECISIONS
from ..targets.loading import DTYPES
from . import UsageError, check_lookup_args, one_line, positive_int
from .analyze import MODEL_HELP, check_device, check_model, check_out_folder

# elsi_fast.training.train.STATE_FILE, repeated here because checks and Ctrl-C hints must not import torch.
TRAINING_STATE_FILE = "training_state.pt"
# eval-draft's finished prompts (elsi_fast.decoding.evaluation.speculative_runs state_path), removed on success.
EVAL_PROGRESS_FILE = "eval_progress.jsonl"


def register(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser(
        "train-draft",
        help="train an EAGLE3 draft head on chosen target layers (EAGLE3 checkpoint format)",
        description="Train an EAGLE3 draft reading the target's hidden states at --layers (input-to-layer ids), "
        "or at the layers a report.json selects with --method/--m, on raw text or on the target's own answers "
        "(`elsi-fast regenerate`: chat template, loss on the answer tokens). The target runs online, or once into "
        f"--cache-dir (offline: every further layer set trains from the cache). The run resumes from "
        f"OUT/{TRAINING_STATE_FILE} unless --no-resume. Under torchrun the global batch is split over the processes.",
    )
    add_target_arguments(train)
    which = train.add_mutually_exclusive_group(required=True)
    which.add_argument("--layers", type=int, nargs="+", help="input-to-layer ids, e.g. 2 6 9")
    which.add_argument("--report", help="report.json from `elsi-fast analyze`; with --method and --m")
    train.add_argument("--method", default="elsi", help="selection method in the report (default elsi)")
    train.add_argument("--m", type=positive_int, default=1, help="number of layers for --report (default 1)")
    train.add_argument("--data", required=True,
                       help="conversations.jsonl of `elsi-fast regenerate`, or raw text: a text file, a folder of .txt, "
                       "or prompts JSONL")
    train.add_argument("--out", required=True, help="output folder (EAGLE3 checkpoint + training state)")
    train.add_argument("--steps", type=positive_int, default=200, help="optimizer steps (default 200)")
    train.add_argument("--batch-size", type=positive_int, default=8,
                       help="conversations or token windows per step, all processes together (default 8)")
    train.add_argument("--seq-len", type=int, default=None,
                       help="tokens per window of raw text (default 128), or per conversation (default 768), >= 3")
    train.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate, warmup then cosine (default 3e-3)")
    train.add_argument("--warmup", type=int, default=20, help="linear warmup steps (default 20)")
    train.add_argument("--ttt-steps", type=positive_int, default=3, help="training-time-test depth (default 3; EAGLE3: 7)")
    train.add_argument("--label-temperature", type=float, default=1.0, metavar="T",
                       help="soft labels: the target's softmax over the draft vocabulary at temperature T (default 1; "
                       "below 1 sharper, towards the greedy token greedy verification accepts)")
    train.add_argument("--labels", choices=("target", "answers"), default="target",
                       help="target: the target's distribution (soft labels); answers: each answer's own next token, "
                       "the target's greedy token in its regenerated conversations, with no target state past the "
                       "draft's deepest layer (a --cache-dir holds the layers only: about layer/N of the forward "
                       "and half the disk) (default target)")
    train.add_argument("--draft-vocab-size", type=positive_int, default=None, help="draft vocabulary size (default: min(vocab, 1024), or --init-from's)")
    train.add_argument("--draft-vocab-coverage", type=float, default=None, metavar="SHARE",
                       help="instead of --draft-vocab-size: the fewest most frequent answer tokens that cover this "
                       "share of them (e.g. 0.97; with --init-from, added to its vocabulary)")
    train.add_argument("--intermediate-size", type=positive_int, default=None, help="draft MLP width (default: the target's)")
    train.add_argument("--save-every", type=positive_int, default=50,
                       help="write the checkpoint and training state every this many steps (default 50)")
    train.add_argument("--seed", type=int, default=0, help="seed of the initialization and data order (default 0)")
    train.add_argument("--init", choices=("random", "target"), default="random",
                       help="draft initialization: random, or warm-started from the target's last block, head rows "
                       "and final norm (default random)")
    train.add_argument("--init-from", default=None, metavar="DRAFT",
                       help="continue from this draft folder (a kept draft, more data or a second schedule): its "
                       "weights and draft vocabulary, a fresh optimizer; same layers; a larger --draft-vocab-size grows the "
                       "vocabulary with the data's most frequent tokens it lacks (default: its size)")
    train.add_argument("--cache-dir", default=None,
                       help="offline training: dump the target's states on the conversations here once (or reuse them)")
    train.add_argument("--cache-layers", type=int, nargs="+", default=None,
                       help="layers to dump into --cache-dir, a superset of every run's (default: this run's)")
    train.add_argument("--cache-dtype", choices=("float32", "bfloat16"), default="float32",
                       help="precision of the dumped states (default float32: the same loss as online training)")
    train.add_argument("--max-cache-gb", type=float, default=32.0, help="refuse a cache larger than this (default 32)")
    train.add_argument("--precision", choices=TRAINING_PRECISIONS, default="auto",
                       help="auto: bf16 autocast where the CPU multiplies bf16 natively (AVX512-BF16, AMX) or on a "
                       "GPU, fp32 elsewhere; fp32 master weights and loss either way (default auto)")
    train.add_argument("--keep-steps", type=positive_int, nargs="+", default=(),
                       help="also keep the draft at these steps, in OUT/checkpoints/step-NNNNNN (a tau curve)")
    train.add_argument("--no-resume", action="store_true", help="start over even if OUT holds a training state")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(func=train_handler, check=train_check, interrupted=train_interrupted)

    evaluate = subparsers.add_parser(
        "eval-draft",
        help="mean acceptance length tau of a draft per prompt category (greedy speculative decoding)",
        description="Speculative decoding of each prompt with the target and the draft; prints tau "
        "(tokens per target forward) per category and over all prompts. Each finished prompt is saved to "
        f"DRAFT/{EVAL_PROGRESS_FILE}, so a rerun after Ctrl-C continues with the rest; the file is removed "
        "when the run completes. With --replay instead of --prompts, tau is replayed from the target's cached "
        "greedy continuations and states: the same rounds, no target forward (docs/experiments.md).",
    )
    add_target_arguments(evaluate)
    evaluate.add_argument("--draft", required=True, help="EAGLE3 draft folder (config.json + model.safetensors)")
    source = evaluate.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts", help="JSONL with 'category' (Spec-Bench), text file, or folder")
    source.add_argument("--replay", metavar="FOLDER",
                        help="replay on the target's greedy continuations: an `elsi-fast regenerate` folder (or its "
                        "conversations.jsonl) at temperature 0, with the target's states on them in FOLDER/states")
    evaluate.add_argument("--k", type=positive_int, default=4, help="draft tokens per round (default 4)")
    evaluate.add_argument("--max-new-tokens", type=int, default=None,
                          help="most tokens generated per prompt, >= 2; an answer stops after the target's end-of-turn "
                          "or end-of-sequence token (default 48; a replay generates each continuation)")
    evaluate.add_argument("--ignore-eos", action="store_const", const=True, default=None,
                          help="generate all --max-new-tokens, past the end of the answer, as throughput benchmarks "
                          "do (the text after the end is no answer, and tau there is not a served draft's)")
    evaluate.add_argument("--max-prompts", type=positive_int, default=None, help="prompts per category (default: all)")
    evaluate.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                          help="truncate prompts to this many tokens (default 256)")
    evaluate.add_argument("--states", default=None,
                          help="--replay: the feature cache of the target's states on the continuations "
                          "(default FOLDER/states)")
    evaluate.add_argument("--cache-layers", type=int, nargs="+", default=None,
                          help="--replay: dump --states for these layers (the draft's or a superset) when absent or "
                          "unfinished: the replay's only target forward")
    evaluate.add_argument("--cache-dtype", choices=("float32", "bfloat16"), default="float32",
                          help="--replay --cache-layers: precision of the dumped states (default float32: the "
                          "rounds of live decoding exactly)")
    evaluate.add_argument("--draft-dtype", choices=NATIVE_WEIGHT_DTYPES, default=None,
                          help="native draft weights (int8/bf16 for memory-bound CPUs); an explicit value must "
                          "run natively (default: the draft's own precision, torch with a warning if not native)")
    evaluate.add_argument("--draft-backend", choices=DRAFT_BACKENDS, default="auto",
                          help="draft decode path (default auto: native when it can run)")
    evaluate.add_argument("--target-runtime", choices=NATIVE_WEIGHT_DTYPES, default=None,
                          help="run the target's decode and verify forwards on elsi-fast's CPU runtime with "
                          "these weights (elsi_fast.targets.target_runtime; faster verify forwards, the same tau for "
                          "the runtime's own greedy decoding; default: torch)")
    evaluate.add_argument("--prompt-lookup", type=positive_int, default=None, metavar="N",
                          help="propose the n-gram lookup's tokens (the tokens that followed the latest earlier "
                          "occurrence of the last N tokens of prompt + output) in the rounds where it finds any, the "
                          "draft's in the others; greedy targets copy, which the lookup predicts (default: the draft "
                          "alone; 2 is a good N)")
    evaluate.add_argument("--lookup-k", type=positive_int, default=None, metavar="K",
                          help="with --prompt-lookup: the most tokens a lookup round proposes (default: -k); they "
                          "cost no draft steps and a copied passage is often accepted whole (7 is a good K: 7 + 1 "
                          "rows are one native forward)")
    evaluate.add_argument("--json", default=None, help="also write the result to this JSON file")
    evaluate.add_argument("--no-progress", action="store_true", help="no progress bar")
    evaluate.set_defaults(func=eval_handler, check=eval_check, interrupted=eval_interrupted)


def _load_texts(path: str, option: str) -> list:
    from ..analysis.prompts import load_prompts

    try:
        return load_prompts(path)
    except (ValueError, FileNotFoundError) as exc:
        message = one_line(exc)
        raise UsageError(f"{option}: {message.removeprefix('prompts: ')}") from None


def _layers_from_report(path: str, method: str, m: int) -> list[int]:
    from ..analysis.report import LayerReport

    if not os.path.isfile(path):
        raise UsageError(f"--report: no such file: {path}")
    try:
        report = LayerReport.from_json(path)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--report: {path} is not valid JSON ({exc}); truncated? rerun `elsi-fast analyze`") from None
    except (ValueError, TypeError) as exc:
        raise UsageError(f"--report: {one_line(exc)}") from None
    try:
        return report.select(method, m)
    except ValueError as exc:
        raise UsageError(f"--method/--m: {one_line(exc)} (in {path})") from None


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help=MODEL_HELP)
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="target weights dtype; a GGUF file is dequantized to it (default float32)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")


def load_target(args: argparse.Namespace):
    from ..targets.loading import load_model

    return load_model(args.target, device=args.device, dtype=args.dtype, argument="--target",
                      device_argument="--device", progress=not args.no_progress)


def read_target_draft(args: argparse.Namespace, embed_tokens, device=None):
    """The --draft folder on the target's embedding; a draft of another target (or an unreadable
    folder) is a usage error that names --draft."""
    from ..draft.formats import read_draft

    try:
        return read_draft(args.draft, embed_tokens=embed_tokens, device=device).eval()
    except ValueError as exc:
        raise UsageError(f"--draft: {args.draft}: {one_line(exc)}") from None


def train_check(args: argparse.Namespace) -> None:
    check_model(args.target, "--target")
    check_device(args.device)
    check_out_folder(args.out)
    if args.layers is not None and any(layer < 0 for layer in args.layers):
        raise UsageError(f"--layers: input-to-layer ids are >= 0 (0 = embeddings), got {args.layers}")
    if args.seq_len is not None and args.seq_len < 3:
        raise UsageError(f"--seq-len: must be >= 3, got {args.seq_len}")
    if not (math.isfinite(args.max_cache_gb) and args.max_cache_gb > 0):
        raise UsageError(f"--max-cache-gb: must be a positive number, got {args.max_cache_gb}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise UsageError(f"--lr: must be a positive number, got {args.lr}")
    if not (math.isfinite(args.label_temperature) and args.label_temperature > 0):
        raise UsageError(f"--label-temperature: must be a positive number, got {args.label_temperature}")
    if args.labels == "answers" and args.label_temperature != 1.0:
        raise UsageError("--label-temperature: labels from the answers are one-hot; drop it or use --labels target")
    if args.warmup < 0:
        raise UsageError(f"--warmup: must be >= 0, got {args.warmup}")
    if args.draft_vocab_coverage is not None:
        if not 0.0 < args.draft_vocab_coverage <= 1.0:
            raise UsageError(f"--draft-vocab-coverage: must be a share in (0, 1], got {args.draft_vocab_coverage}")
        if args.draft_vocab_size is not None:
            raise UsageError("--draft-vocab-coverage: give it or --draft-vocab-size, not both")
    if args.init_from is not None and not os.path.isfile(os.path.join(args.init_from, "config.json")):
        raise UsageError(f"--init-from: {args.init_from} is not a draft folder (no config.json)")
    late = [step for step in args.keep_steps if step > args.steps]
    if late:
        raise UsageError(f"--keep-steps: steps past --steps {args.steps}: {late}")
    args.layer_ids = list(args.layers) if args.layers is not None else _layers_from_report(args.report, args.method, args.m)
    missing = sorted(set(args.layer_ids) - set(args.cache_layers)) if args.cache_layers else []
    if missing:
        raise UsageError(f"--cache-layers: must include this run's layers; {missing} missing")
    from ..training.training_data import is_conversations_file

    args.conversations = is_conversations_file(args.data)
    if args.cache_dir is not None and not args.conversations:
        raise UsageError("--cache-dir: only conversations (elsi-fast regenerate's conversations.jsonl) are cached; "
                         "raw text trains online")
    if args.labels == "answers" and not args.conversations:
        raise UsageError("--labels: answers needs conversations (elsi-fast regenerate's conversations.jsonl); raw "
                         "text is labelled by the target")
    if args.seq_len is None:
        args.seq_len = 768 if args.conversations else 128
    if not args.conversations:
        args.texts = [prompt.text for prompt in _load_texts(args.data, "--data")]


def train_interrupted(args: argparse.Namespace) -> str:
    state = os.path.join(args.out, TRAINING_STATE_FILE)
    if os.path.isfile(state):
        return (f"training is saved in {state} up to the step Ctrl-C interrupted (a second Ctrl-C: up to the last "
                "--save-every step): rerun the same command to continue (--no-resume starts over)")
    return "no training state was saved yet: rerun the command to start over"


def train_handler(args: argparse.Namespace) -> int:
    from ..analysis.pass_state import rank_and_world
    from ..training.train import train_draft

    model, tokenizer = load_target(args)
    data, cache = args.texts if not args.conversations else None, None
    if args.conversations:
        from ..training.training_data import conversation_samples, load_conversations

        data = conversation_samples(load_conversations(args.data), tokenizer, args.seq_len, model.config.vocab_size)
        if args.cache_dir is not None:
            from ..training.feature_cache import build

            cache = build(model, data, args.cache_layers or args.layer_ids, args.cache_dir, dtype=args.cache_dtype,
                          max_bytes=int(args.max_cache_gb * 2**30), final=args.labels == "target",
                          progress=not args.no_progress)
            print(f"feature cache: {cache.path}, {cache.nbytes / 2**30:.2f} GiB for {cache.meta['tokens']} tokens x "
                  f"layers {cache.layers}{' + the final state' if cache.has_final else ''} ({cache.dtype})")
    overrides = {} if args.intermediate_size is None else {"intermediate_size": args.intermediate_size}
    draft, summary = train_draft(
        model, tokenizer, args.layer_ids, data, out_dir=args.out, draft_config=overrides,
        draft_vocab_size=args.draft_vocab_size, draft_vocab_coverage=args.draft_vocab_coverage, steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len, lr=args.lr, warmup=args.warmup, ttt_steps=args.ttt_steps, seed=args.seed,
        label_temperature=args.label_temperature, labels=args.labels, init=args.init, init_from=args.init_from, feature_cache=cache,
        save_every=args.save_every, keep_steps=tuple(args.keep_steps),
        precision=args.precision, resume=not args.no_resume,
        progress=not args.no_progress,
    )
    if rank_and_world()[0] == 0:
        print(f"trained draft on layers {list(draft.config.aux_layer_ids)} (input-to-layer): final loss "
              f"{summary['final_loss']:.4f}, {summary['tokens_per_second_this_run'] or 0:.0f} tokens/s "
              f"({summary['precision_this_run']}); EAGLE3 "
              f"checkpoint in {args.out}")
    return 0


def eval_check(args: argparse.Namespace) -> None:
    check_model(args.target, "--target")
    check_device(args.device)
    check_lookup_args(args)
    if args.target_runtime is not None and args.device not in (None, "cpu"):
        raise UsageError(f"--target-runtime: the target runtime is CPU only, not --device {args.device}")
    if args.json is not None:
        parent = os.path.dirname(os.path.abspath(args.json))
        if os.path.isdir(args.json) or not os.path.isdir(parent):
            raise UsageError(f"--json: cannot write a file at {args.json}; give a file path in an existing folder")
    if not os.path.isfile(os.path.join(args.draft, "config.json")):
        what = "has no config.json" if os.path.isdir(args.draft) else "no such folder"
        raise UsageError(f"--draft: {what}: {args.draft}; give the --out folder of `elsi-fast train-draft`")
    if args.replay is not None:
        from .replay import check_replay

        check_replay(args)
        return
    from .replay import REPLAY_ONLY

    for name, option in REPLAY_ONLY.items():
        if getattr(args, name) is not None:
            raise UsageError(f"{option}: only a replay (--replay) reads cached states; drop {option}")
    args.max_new_tokens = 48 if args.max_new_tokens is None else args.max_new_tokens
    args.max_prompt_tokens = 256 if args.max_prompt_tokens is None else args.max_prompt_tokens
    if args.max_new_tokens < 2:
        raise UsageError(f"--max-new-tokens: must be >= 2 (one verification round), got {args.max_new_tokens}")
    args.prompt_list = _load_texts(args.prompts, "--prompts")


def _eval_progress_file(args: argparse.Namespace) -> str:
    # Beside the draft it measures; another target, prompt set or setting starts it over.
    return os.path.join(args.draft, EVAL_PROGRESS_FILE)


def eval_interrupted(args: argparse.Namespace) -> str:
    if args.replay is not None:
        if args.cache_layers is not None:
            return f"the states dumped so far are kept in {args.states}: rerun the same command to continue"
        return "a replay keeps no progress: rerun the command"
    if os.path.isfile(_eval_progress_file(args)):
        return (f"the prompts finished so far are saved in {_eval_progress_file(args)}: rerun the same command to "
                "continue with the rest")
    return "no prompt had finished: rerun the command"


def print_tau_table(taus: dict[str, float], prompts: dict[str, int]) -> None:
    """tau per category, then pooled ("all"), with each row's prompt count."""
    print(f"{'category':<24} {'prompts':>7} {'tau':>6}")
    for category, tau in taus.items():
        count = sum(prompts.values()) if category == "all" else prompts[category]
        print(f"{category:<24} {count:>7} {tau:>6.3f}")


def lookup_note(args: argparse.Namespace) -> str:
    if args.prompt_lookup is None:
        return ""
    proposing = "" if args.lookup_k is None else f", up to {args.lookup_k} tokens"
    return f", prompt lookup n={args.prompt_lookup}{proposing} before the draft"


def eval_handler(args: argparse.Namespace) -> int:
    from ..analysis.prompts import prompts_by_category
    from ..decoding.evaluation import pooled_tau, speculative_runs
    from ..targets.loading import stop_token_ids
    from ..targets.target_runtime import accelerate, describe_target

    if args.replay is not None:
        from .replay import replay_handler

        return replay_handler(args)
    model, tokenizer = load_target(args)
    if args.target_runtime is not None:
        try:
            accelerate(model, args.target_runtime)
        except ValueError as exc:
            raise UsageError(f"--target-runtime: {exc}") from None
    draft = read_target_draft(args, model.get_input_embeddings().weight.detach(), device=model.device)
    grouped = prompts_by_category(args.prompt_list, tokenizer, args.max_prompts, args.max_prompt_tokens)
    progress_file = _eval_progress_file(args) if os.access(args.draft, os.W_OK) else None
    stops = None if args.ignore_eos else stop_token_ids(model, tokenizer)
    runs = speculative_runs(model, draft, grouped, k=args.k, max_new_tokens=args.max_new_tokens,
                            draft_dtype=args.draft_dtype, draft_backend=args.draft_backend, eos_token_id=stops,
                            progress=not args.no_progress, state_path=progress_file, prompt_lookup=args.prompt_lookup,
                            lookup_k=args.lookup_k)
    taus = pooled_tau(runs)
    results = [result for per_prompt in runs.values() for result in per_prompt]
    draft_calls = {key: sum(r.draft_calls.get(key, 0) for r in results) for key in results[0].draft_calls}
    backend = results[0].draft_backend.split(":")[0]
    print(f"draft layers {list(draft.config.aux_layer_ids)}, k={args.k}, {args.max_new_tokens} new tokens per prompt"
          f"{lookup_note(args)}; target: {describe_target(model)}")
    print(f"draft backend: {backend}; calls over all prompts: "
          + ", ".join(f"{key} {count}" for key, count in draft_calls.items()))
    print_tau_table(taus, {category: len(prompts) for category, prompts in grouped.items()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"draft": args.draft, "layers": list(draft.config.aux_layer_ids), "k": args.k,
                       "max_new_tokens": args.max_new_tokens, "stop_ids": stops, "prompt_lookup": args.prompt_lookup,
                       "lookup_k": args.lookup_k,
                       "tau": taus, "draft_backend": backend,
                       "draft_calls": draft_calls, "target_backend": describe_target(model)}, f, indent=1)
    if progress_file is not None:
        os.remove(progress_file)
    return 0
