"""`elsi-fast demo`: the whole method offline, on a small target trained from the Python stdlib.

1. build (first run, a few minutes on two cores) or reuse the cached 12-layer demo target, or take
   --model (a named real target, a .gguf, a transformers folder: the demo's steps on your model);
2. run `elsi-fast analyze` on held-out stdlib code: layer table, plots, serving configs in OUT;
3. with --train-drafts, train two drafts with the same budget, ELSI m=1 and the EAGLE3 default
   m=3, and print their mean acceptance length side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from .analyze import MODEL_HELP

_CALIBRATION_PROMPTS = 64
_EVAL_PROMPTS = 8


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="offline demo: train/reuse a small stdlib-Python target, analyze it, optionally train two drafts",
        description="Needs no network: the target is trained on this Python installation's standard library "
        "and cached (ELSI_FAST_CACHE or ~/.cache/elsi-fast).",
    )
    parser.add_argument("--out", default="elsi-fast-demo", help="output folder (default ./elsi-fast-demo)")
    parser.add_argument("--model", default=None,
                        help="run the demo's steps on this target instead of the demo target: " + MODEL_HELP)
    parser.add_argument("--train-drafts", action="store_true",
                        help="also train ELSI m=1 and EAGLE3-default m=3 drafts and compare their tau")
    parser.add_argument("--steps", type=int, default=80, help="training steps per draft, with --train-drafts (default 80)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=handler, check=check, interrupted=interrupted)


def check(args: argparse.Namespace) -> None:
    from . import UsageError
    from .analyze import check_model, check_out_folder

    check_out_folder(args.out)
    if args.model is not None:
        check_model(args.model, "--model")
    if args.steps < 1:
        raise UsageError(f"--steps: must be >= 1, got {args.steps}")


def interrupted(args: argparse.Namespace) -> str:
    return ("rerun the same command: the demo target (cached in $ELSI_FAST_CACHE or ~/.cache/elsi-fast) and the "
            "drafts continue from their last saved step, or are reused when finished")


def _calibration_file(out: str) -> str:
    """Held-out stdlib code, one prompt per source file (its held-out tail), blank-line separated."""
    from ..targets.toy_targets import DEMO, heldout_texts

    # Blank lines inside a prompt would split it: collapse them.
    chunks = ["\n".join(line for line in text[:1500].splitlines() if line.strip()) for text in heldout_texts(DEMO)]
    chunks = [c for c in chunks if len(c) >= 100]
    step = max(1, len(chunks) // _CALIBRATION_PROMPTS)
    path = os.path.join(out, "calibration.txt")
    with open(path, "w") as f:
        f.write("\n\n".join(chunks[::step][:_CALIBRATION_PROMPTS]))
    return path


def _train_and_compare(target_dir: str, out: str, steps: int, progress: bool) -> None:
    from ..analysis.report import LayerReport
    from ..decoding.evaluation import evaluate_tau
    from ..targets.loading import load_model
    from ..targets.toy_targets import DEMO, heldout_texts, training_texts
    from ..training.train import train_draft

    model, tokenizer = load_model(target_dir, device="cpu", dtype="float32")
    report = LayerReport.from_json(os.path.join(out, "report.json"))
    contenders = {"ELSI m=1": report.select("elsi", 1), "EAGLE3 default m=3": report.select("eagle3", 3)}
    texts = training_texts(DEMO)
    held = [t for t in heldout_texts(DEMO) if len(t) >= 100]
    step = max(1, len(held) // _EVAL_PROMPTS)
    prompts = {"stdlib": [tokenizer(t[:1000])["input_ids"][:64] for t in held[::step][:_EVAL_PROMPTS]]}
    taus = {}
    for label, layers in contenders.items():
        folder = os.path.join(out, "drafts", "-".join(map(str, layers)))
        # Same budget and data order for both; a finished run in OUT is reused (resume).
        draft, _ = train_draft(model, tokenizer, layers, texts, out_dir=folder, steps=steps, batch_size=8,
                               seq_len=128, warmup=max(1, steps // 10), seed=0, progress=progress)
        taus[label] = evaluate_tau(model, draft, prompts, k=4, max_new_tokens=32, progress=progress)["all"]
    print(f"\n{'draft':<20} {'layers':<12} {'fc inputs':>9} {'tau (k=4)':>9}")
    for label, layers in contenders.items():
        print(f"{label:<20} {str(layers):<12} {len(layers) * model.config.hidden_size:>9} {taus[label]:>9.3f}")
    with open(os.path.join(out, "drafts", "tau.json"), "w") as f:
        json.dump({label: {"layers": contenders[label], "tau": taus[label]} for label in contenders}, f, indent=1)


def _training_file(out: str) -> str:
    """The target's training text (stdlib code), for `elsi-fast train-draft --data`."""
    from ..targets.toy_targets import DEMO, training_texts

    path = os.path.join(out, "train.txt")
    with open(path, "w") as f:
        f.write("\n\n".join(training_texts(DEMO)))
    return path


def _link_target(target_dir: str, out: str) -> str:
    """OUT/target -> the cached target, so later commands can say `--target OUT/target`."""
    link = os.path.join(out, "target")
    if os.path.islink(link) or os.path.exists(link):
        os.remove(link)
    os.symlink(os.path.abspath(target_dir), link)
    return link


def handler(args: argparse.Namespace) -> int:
    from ..targets.toy_targets import build_demo_target
    from . import build_parser

    start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    if args.model is None:
        target_dir = str(build_demo_target(progress=not args.no_progress))
        link = _link_target(target_dir, args.out)
        print(f"demo target: {target_dir} ({time.perf_counter() - start:.0f}s), linked as {link}")
    else:
        target_dir = link = args.model
    built = time.perf_counter()

    analyze_argv = ["analyze", "--model", target_dir, "--prompts", _calibration_file(args.out), "--out", args.out,
                    "--m", "1", "3", "--device", "cpu", "--max-tokens", "128"]
    if args.no_progress:
        analyze_argv.append("--no-progress")
    analyze_args = build_parser().parse_args(analyze_argv)
    analyze_args.check(analyze_args)
    code = analyze_args.func(analyze_args)
    if code:
        return code
    analyzed = time.perf_counter()
    data = _training_file(args.out)
    if args.train_drafts:
        _train_and_compare(target_dir, args.out, args.steps, not args.no_progress)
    done = time.perf_counter()
    print(f"\ntimes: target {built - start:.0f}s, analysis {analyzed - built:.0f}s"
          + (f", drafts {done - analyzed:.0f}s" if args.train_drafts else "") + f", total {done - start:.0f}s")
    print(f"\nnext: elsi-fast train-draft --target {link} --report {os.path.join(args.out, 'report.json')} "
          f"--method elsi --m 1 --data {data} --out {os.path.join(args.out, 'drafts', 'elsi1')}")
    return 0
