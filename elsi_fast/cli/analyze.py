"""`elsi-fast analyze`: one pass over prompts -> report.json, plots and serving configs."""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import warnings

from . import UsageError, one_line, positive_int

_DTYPES = ("auto", "float32", "bfloat16", "float16")
# The library's default (elsi_fast.analysis.DEFAULT_MIN_TOKEN_ENTROPY), repeated for --help, which
# must not import torch; tests/test_cli_validation.py checks that the two agree.
MIN_TOKEN_ENTROPY_HELP_DEFAULT = 0.5
STATE_FILE = "state.pt"
# A hub id: "name" or "owner/name" of letters, digits, '.', '_', '-'; not a path or a checkpoint file.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_CHECKPOINT_SUFFIXES = (".bin", ".pt", ".pth", ".safetensors", ".gguf", ".json")
_DEVICE = re.compile(r"cpu|auto|cuda(:\d+)?|mps")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "analyze",
        help="measure per-layer entropy and CKA of a causal LM and choose EAGLE3 draft layers",
        description="One streaming pass of MODEL over PROMPTS; writes report.json, entropy.png, cka.png, "
        "pair_gain.png and serving_configs.json to OUT. Layer indices are input-to-layer (h_0 = embeddings, "
        "h_N = last block output before the final norm).",
    )
    parser.add_argument("--model", required=True, help="Hugging Face hub id or local folder, or a llama2.c .bin")
    parser.add_argument("--prompts", required=True, help="JSONL (Spec-Bench/MT-bench 'turns'), text file, or folder of .txt")
    parser.add_argument("--out", required=True, help="output folder (created; files in it are overwritten)")
    parser.add_argument("--m", type=positive_int, nargs="+", default=[1, 3], help="set sizes to select (default: 1 3)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 or auto (device_map='auto'); default: cuda if available")
    parser.add_argument("--dtype", choices=_DTYPES, default="auto", help="model weights dtype (default: bf16 on GPU, fp32 on CPU)")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="prompts per forward pass (default 8)")
    parser.add_argument("--max-prompts", type=positive_int, default=None, help="use only the first N prompts (default: all)")
    parser.add_argument("--max-tokens", type=int, default=512, help="truncate each prompt to this many tokens, >= 2 (default 512)")
    parser.add_argument(
        "--min-token-entropy", type=float, default=None,
        help="keep tokens whose next-token entropy is at least this many nats; 0 disables "
        f"(default {MIN_TOKEN_ENTROPY_HELP_DEFAULT})",
    )
    parser.add_argument("--gram-tokens", type=int, default=None,
                        help="cap on the kept tokens per prompt of the prompt-mode statistics, >= 2 "
                        "(default: all kept tokens, as DESIGN.md defines them)")
    parser.add_argument("--beta", type=float, default=1.0, help="ELSI-C CKA penalty weight (default 1.0)")
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


def looks_like_hub_id(name: str) -> bool:
    return bool(_HUB_ID.fullmatch(name)) and not name.endswith(_CHECKPOINT_SUFFIXES)


def check_model(name: str, option: str) -> int | None:
    """Checks a model argument without loading it; returns N (decoder blocks) when a local
    config.json says it, else None."""
    if os.path.isdir(name):
        config = os.path.join(name, "config.json")
        if not os.path.isfile(config):
            raise UsageError(f"{option}: folder {name} has no config.json; give a transformers model folder, "
                             "a llama2.c .bin or a hub id")
        try:
            with open(config) as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            raise UsageError(f"{option}: cannot read {config} ({one_line(exc)})") from None
        data = data.get("text_config", data) if isinstance(data, dict) else {}
        blocks = data.get("num_hidden_layers")
        return blocks if isinstance(blocks, int) and blocks > 0 else None
    if os.path.exists(name):
        return None  # a file: the loader tells a llama2.c checkpoint from anything else
    if not looks_like_hub_id(name):
        raise UsageError(f"{option}: no such file or folder: {name}")
    return None


def check_device(device: str | None) -> None:
    if device is not None and not _DEVICE.fullmatch(device):
        raise UsageError(f"--device: expected cpu, cuda, cuda:N or auto, got {device!r}")


def check_set_sizes(m: list[int], blocks: int, source: str) -> None:
    """The default candidates are h_1 .. h_{N-1} (elsi_fast.analysis.AnalyzeOptions)."""
    too_big = [size for size in m if size > blocks - 1]
    if too_big:
        raise UsageError(f"--m: each set size must be at most {blocks - 1}, the candidate layers h_1..h_{blocks - 1} "
                         f"of this {blocks}-block model ({source}); got {too_big}")


def check_out_folder(out: str, option: str = "--out") -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"{option}: {out} exists and is not a folder; give a folder path")


def check(args: argparse.Namespace) -> None:
    from ..prompts import load_prompts

    blocks = check_model(args.model, "--model")
    check_device(args.device)
    check_out_folder(args.out)
    if args.max_tokens < 2:
        raise UsageError(f"--max-tokens: must be >= 2 (position 0 is always dropped), got {args.max_tokens}")
    if args.gram_tokens is not None and args.gram_tokens < 2:
        raise UsageError(f"--gram-tokens: must be >= 2, got {args.gram_tokens}")
    if args.min_token_entropy is not None and not (math.isfinite(args.min_token_entropy) and args.min_token_entropy >= 0):
        raise UsageError(f"--min-token-entropy: must be a number >= 0 (nats; 0 disables the filter), got {args.min_token_entropy}")
    if not math.isfinite(args.beta):
        raise UsageError(f"--beta: must be a finite number, got {args.beta}")
    if blocks is not None:
        check_set_sizes(args.m, blocks, "its config.json")
    if args.resume and not state_files(args.out):
        raise UsageError(f"--resume: no {STATE_FILE} in {args.out} to continue from; run without --resume")
    try:
        args.prompt_list = load_prompts(args.prompts, max_prompts=args.max_prompts)
    except (ValueError, FileNotFoundError) as exc:
        raise UsageError(f"--{one_line(exc)}" if str(exc).startswith("prompts:") else f"--prompts: {one_line(exc)}") from None


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


def load_model(name: str, device: str | None, dtype: str, option: str = "--model"):
    """(model, tokenizer) for a hub id / folder or a llama2.c checkpoint; device "auto" means
    device_map="auto" (large models over several GPUs)."""
    import torch

    from ..llama2c import is_llama2c_checkpoint, load_llama2c, load_llama2c_tokenizer

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device: CUDA is not available on this machine; use --device cpu")
    if dtype == "auto":
        torch_dtype = torch.bfloat16 if device != "cpu" else torch.float32
    else:
        torch_dtype = getattr(torch, dtype)
    if is_llama2c_checkpoint(name):
        model = load_llama2c(name, dtype=torch_dtype)
        return model.to("cpu" if device == "auto" else device), load_llama2c_tokenizer(name)
    if os.path.isfile(name):
        raise UsageError(f"{option}: {name} is a file but not a llama2.c checkpoint; give a model folder or hub id")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"dtype": torch_dtype}
    if device == "auto":
        kwargs["device_map"] = "auto"
    try:
        model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(name)
    except OSError as exc:
        where = "the folder" if os.path.isdir(name) else "not a local file or folder, and the hub id"
        raise UsageError(f"{option}: {name}: {where} could not be loaded ({one_line(exc)[:300]})") from None
    if device != "auto":
        model = model.to(device)
    return model, tokenizer


def serving_configs(report) -> dict:
    """Every selection of `report` (all methods and m) for every engine, with its caveats."""
    from ..serving import ENGINES

    configs = {}
    for method, by_m in report.selections.items():
        for m in sorted(by_m, key=int):
            layers = report.select(method, int(m))
            for engine in ENGINES:
                key = f"{method}/m={m}/{engine}"
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        config = report.serving_config(engine, m=int(m), method=method)
                    configs[key] = {"layers": layers, "config": config,
                                    "notes": report.serving_notes(engine, int(m), method)}
                except ValueError as exc:  # e.g. h_0 in an output-of-layer engine
                    configs[key] = {"layers": layers, "config": None, "notes": [str(exc)]}
    return configs


def handler(args: argparse.Namespace) -> int:
    from ..analysis import AnalyzeOptions, analyze
    from ..capture import decoder_layers
    from ..serving import ENGINES

    model, tokenizer = load_model(args.model, args.device, args.dtype)
    try:  # N-dependent limits of --m, for models whose N was unknown before loading
        AnalyzeOptions(m=tuple(args.m)).validate(len(decoder_layers(model)))
    except ValueError as exc:
        raise UsageError(f"--{one_line(exc)}") from None
    os.makedirs(args.out, exist_ok=True)
    state_path = os.path.join(args.out, STATE_FILE)
    if not args.resume:
        for path in run_files(args.out):
            os.remove(path)  # a fresh run; --resume keeps them
    extra = {} if args.min_token_entropy is None else {"min_token_entropy": args.min_token_entropy}
    report = analyze(
        model,
        tokenizer,
        args.prompt_list,
        m=args.m,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        gram_tokens=args.gram_tokens,
        beta=args.beta,
        one_per_compartment=args.one_per_compartment,
        state_path=state_path,
        progress=not args.no_progress,
        model_name=args.model,
        **extra,
    )
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
    return 0
