"""`elsi-fast analyze`: one pass over prompts -> report.json, plots and serving configs."""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re

from ..analysis.analysis_options import DEFAULTS
from ..targets.catalog import CATALOG
from ..targets.loading import DTYPES
from . import UsageError, one_line, positive_int

STATE_FILE = "state.pt"
# The main job's budget: 120 Spec-Bench prompts (about 9 per category) take a few minutes on 2 CPU
# cores and spill under 1 GiB; the picks from all 480 are in docs/real-models.md.
DEFAULT_PROMPT_BUDGET = 120
DEFAULT_STORE_GB = 1.0
_DEVICE = re.compile(r"cpu|auto|cuda(:\d+)?|mps")
MODEL_HELP = ("a named real target (" + ", ".join(CATALOG) + "), a .gguf file or a folder holding one, a "
              "transformers model folder or hub id, or a llama2.c .bin")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "analyze",
        help="measure per-layer entropy and CKA of a causal LM and choose EAGLE3 draft layers",
        description="One streaming pass of MODEL over PROMPTS; writes report.json, entropy.png, cka.png, "
        "pair_gain.png and serving_configs.json to OUT. Layer indices are input-to-layer (h_0 = embeddings, "
        "h_N = last block output before the final norm).",
    )
    parser.add_argument("--model", required=True, help=MODEL_HELP)
    parser.add_argument("--prompts", required=True, help="JSONL (Spec-Bench/MT-bench 'turns'), text file, or folder of .txt")
    parser.add_argument("--out", required=True, help="output folder (created; files in it are overwritten)")
    parser.add_argument("--m", type=positive_int, nargs="+", default=list(DEFAULTS.m),
                        help=f"set sizes to select (default: {' '.join(map(str, DEFAULTS.m))})")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 or auto (device_map='auto'); default: cuda if available")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="model weights dtype; a GGUF file is dequantized to it (default: bf16 on GPU, fp32 on CPU)")
    parser.add_argument("--batch-size", type=positive_int, default=DEFAULTS.batch_size,
                        help=f"prompts per forward pass (default {DEFAULTS.batch_size})")
    parser.add_argument("--max-prompts", type=positive_int, default=None,
                        help=f"use N prompts, taken in turn from each category (default {DEFAULT_PROMPT_BUDGET}: a few "
                        "minutes on 2 CPU cores; the picks of all 480 Spec-Bench prompts in docs/real-models.md)")
    parser.add_argument("--all-prompts", action="store_true", help="use every prompt of --prompts (no budget)")
    parser.add_argument("--max-tokens", type=int, default=DEFAULTS.max_tokens,
                        help=f"truncate each prompt to this many tokens, >= 2 (default {DEFAULTS.max_tokens})")
    parser.add_argument("--min-token-entropy", type=float, default=DEFAULTS.min_token_entropy,
                        help="keep tokens whose next-token entropy is at least this many nats; 0 disables "
                        f"(default {DEFAULTS.min_token_entropy})")
    parser.add_argument("--gram-tokens", type=int, default=DEFAULTS.gram_tokens,
                        help="cap on the kept tokens per prompt of the prompt-mode statistics, >= 2 "
                        "(default: all kept tokens, as docs/method.md section 3 defines them)")
    parser.add_argument("--max-store-gb", type=float, default=DEFAULT_STORE_GB,
                        help="bound on the prompt-mode spill file in OUT (GiB): where all kept tokens could exceed it, "
                        "each prompt's prompt-mode tokens are capped to fit and the report says so; 0: no bound "
                        f"(default {DEFAULT_STORE_GB:g})")
    parser.add_argument("--beta", type=float, default=DEFAULTS.beta,
                        help=f"ELSI-C CKA penalty weight (default {DEFAULTS.beta})")
    parser.add_argument("--one-per-compartment", action="store_true", help="ELSI-C: at most one layer per compartment")
    parser.add_argument("--resume", action="store_true",
                        help=f"continue from OUT/{STATE_FILE} of an interrupted run (same command otherwise)")
    parser.add_argument("--keep-state", action="store_true",
                        help=f"keep OUT/{STATE_FILE} (the accumulator state) after a successful run; default: removed")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=handler, check=check, interrupted=interrupted)


# ---------------------------------------------------------------------------------------------
# Checks before any heavy import (shared with train-draft / eval-draft)
# ---------------------------------------------------------------------------------------------


def check_model(name: str, option: str) -> int | None:
    """Checks a model argument without loading it (elsi_fast.targets.loading.describe_source); returns N
    (decoder blocks) when a config.json or GGUF header says it, else None."""
    from ..targets.loading import describe_source

    try:
        return describe_source(name, option).num_blocks
    except ValueError as exc:
        raise UsageError(one_line(exc)) from None


def check_device(device: str | None) -> None:
    if device is not None and not _DEVICE.fullmatch(device):
        raise UsageError(f"--device: expected cpu, cuda, cuda:N or auto, got {device!r}")


def check_set_sizes(m: list[int], blocks: int, source: str) -> None:
    """The default candidates are h_1 .. h_{N-1} (elsi_fast.engines.layer_ids.common_candidate_layers)."""
    too_big = [size for size in m if size > blocks - 1]
    if too_big:
        raise UsageError(f"--m: each set size must be at most {blocks - 1}, the candidate layers h_1..h_{blocks - 1} "
                         f"of this {blocks}-block model ({source}); got {too_big}")


def check_out_folder(out: str, option: str = "--out") -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"{option}: {out} exists and is not a folder; give a folder path")


def check(args: argparse.Namespace) -> None:
    from ..analysis.prompts import load_prompts, spread_over_categories

    blocks = check_model(args.model, "--model")
    check_device(args.device)
    check_out_folder(args.out)
    if args.max_tokens < 2:
        raise UsageError(f"--max-tokens: must be >= 2 (position 0 is always dropped), got {args.max_tokens}")
    if args.gram_tokens is not None and args.gram_tokens < 2:
        raise UsageError(f"--gram-tokens: must be >= 2, got {args.gram_tokens}")
    if not (math.isfinite(args.min_token_entropy) and args.min_token_entropy >= 0):
        raise UsageError(f"--min-token-entropy: must be a number >= 0 (nats; 0 disables the filter), got {args.min_token_entropy}")
    if not (math.isfinite(args.max_store_gb) and args.max_store_gb >= 0):
        raise UsageError(f"--max-store-gb: must be a number >= 0 (GiB; 0: no bound), got {args.max_store_gb}")
    if args.all_prompts and args.max_prompts is not None:
        raise UsageError("--all-prompts: give either --all-prompts or --max-prompts, not both")
    if not math.isfinite(args.beta):
        raise UsageError(f"--beta: must be a finite number, got {args.beta}")
    if blocks is not None:
        check_set_sizes(args.m, blocks, "its config.json or GGUF header")
    if args.resume and not state_files(args.out):
        raise UsageError(f"--resume: no {STATE_FILE} in {args.out} to continue from; run without --resume")
    try:
        args.prompt_list = load_prompts(args.prompts)
    except (ValueError, FileNotFoundError) as exc:
        raise UsageError(f"--{one_line(exc)}" if str(exc).startswith("prompts:") else f"--prompts: {one_line(exc)}") from None
    if not args.all_prompts:
        args.prompt_list = spread_over_categories(args.prompt_list, args.max_prompts or DEFAULT_PROMPT_BUDGET)


def state_files(out: str) -> list[str]:
    """OUT/state.pt, or its per-rank files under torchrun: what --resume continues from."""
    prefix = os.path.join(glob.escape(out), STATE_FILE)
    return sorted(path for path in glob.glob(prefix) + glob.glob(prefix + ".rank*") if not path.endswith(".factors"))


def run_files(out: str) -> list[str]:
    """Every file of the pass state: the state files and the prompt-mode factor files beside them
    (state.pt.factors, .factors.all, per rank), all removed together."""
    return sorted(glob.glob(os.path.join(glob.escape(out), STATE_FILE) + "*"))


def interrupted(args: argparse.Namespace) -> str:
    if state_files(args.out):
        return (f"the pass is saved in {os.path.join(args.out, STATE_FILE)} up to the batch Ctrl-C interrupted (a "
                "second Ctrl-C: up to the last periodic save): rerun the same command with --resume to continue")
    return "no state was saved yet: rerun the command to start over"


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def handler(args: argparse.Namespace) -> int:
    from ..analysis.analyze import AnalyzeOptions, analyze
    from ..engines.layer_ids import ENGINES
    from ..engines.serving import serving_configs
    from ..targets.capture import decoder_layers
    from ..targets.loading import load_model

    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype, argument="--model",
                                  device_argument="--device", progress=not args.no_progress)
    try:  # N-dependent limits of --m, for models whose N was unknown before loading
        AnalyzeOptions(m=tuple(args.m)).validate(len(decoder_layers(model)))
    except ValueError as exc:
        raise UsageError(f"--{one_line(exc)}") from None
    os.makedirs(args.out, exist_ok=True)
    state_path = os.path.join(args.out, STATE_FILE)
    if not args.resume:
        for path in run_files(args.out):
            os.remove(path)  # a fresh run; --resume keeps them
    report = analyze(
        model,
        tokenizer,
        args.prompt_list,
        m=args.m,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        min_token_entropy=args.min_token_entropy,
        gram_tokens=args.gram_tokens,
        max_store_bytes=round(args.max_store_gb * 2**30) or None,
        beta=args.beta,
        one_per_compartment=args.one_per_compartment,
        state_path=state_path,
        progress=not args.no_progress,
        model_name=args.model,
    )
    from ..analysis.pass_state import rank_and_world

    if rank_and_world()[0] != 0:
        return 0  # every rank holds the whole result; rank 0 writes it
    report.to_json(os.path.join(args.out, "report.json"))
    plots = report.plot(args.out)
    configs = serving_configs(report)
    with open(os.path.join(args.out, "serving_configs.json"), "w") as f:
        json.dump(configs, f, indent=1)
    if not args.keep_state:
        for path in run_files(args.out):
            os.remove(path)  # 100+ MiB of state and factors; the report holds every result

    print(report.table())
    print(f"\npass {report.timing['pass_seconds']:.1f} s, selection {report.timing['selection_seconds']:.1f} s")
    m = 3 if 3 in args.m else max(args.m)
    print(f"\nserving (ELSI, m={m}); all methods and engines in serving_configs.json:")
    for engine in ENGINES:
        entry = configs[f"elsi/m={m}/{engine}"]
        print(f"  {engine:<11} {json.dumps(entry['config'])}")
        for note in entry["notes"]:
            print(f"  {'':<11} note: {note}")
    print(f"\nwrote {os.path.join(args.out, 'report.json')}, {', '.join(os.path.basename(p) for p in plots)}, serving_configs.json")
    for line in kept_draft_lines(args.model, report):
        print(line)
    return 0


# Drafts kept in the repository (bench/keep_draft.py): found from a source checkout only.
KEPT_DRAFTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "bench", "results", "drafts")


def kept_draft_lines(model: str, report) -> list[str]:
    """Lines naming the kept drafts of this target (bench/results/drafts/<model>/), the one whose
    layers this run picked first, with their tau and the commands that measure and serve them."""
    folder = os.path.join(KEPT_DRAFTS, str(model))
    if not os.path.isdir(folder):
        return []
    picks = {(method, int(m)): layers for method, by_m in report.selections.items() for m, layers in by_m.items()}
    kept = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name, "training.json")
        if os.path.isfile(path):
            with open(path) as f:
                facts = json.load(f)
            matching = [f"{method} m={m}" for (method, m), layers in sorted(picks.items()) if layers == facts["layers"]]
            kept.append((not matching, name, os.path.join(folder, name), facts, matching))
    lines = []
    for _, name, path, facts, matching in sorted(kept):
        tau = facts["tau"].get("spec-bench", {}).get("k=4")
        tau = "not measured" if tau is None else f"{tau:.3f}"
        match = f"this run's {', '.join(matching)} pick" if matching else "not a pick of this run"
        lines.append(f"\nkept draft {name}: layers {facts['layers']} ({match}), tau {tau} at k=4 on Spec-Bench, "
                     f"trained on {facts['conversations']} conversations")
        lines.append(f"  measure: elsi-fast eval-draft --target {model} --draft {os.path.relpath(path)} "
                     "--prompts ../shared/data/prompts/spec_bench_question.jsonl --k 4 --max-new-tokens 128")
        lines.append(f"  serve:   elsi-fast serve --draft {os.path.relpath(path)} --engine vllm --target {model} -k 4")
    return lines
