"""`elsi-fast analyze`: one pass over prompts -> report.json, plots and serving configs."""

from __future__ import annotations

import argparse
import json
import os
import warnings

from ..analysis import DEFAULT_MIN_TOKEN_ENTROPY

_DTYPES = ("auto", "float32", "bfloat16", "float16")


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
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 3], help="set sizes to select (default: 1 3)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 or auto (device_map='auto'); default: cuda if available")
    parser.add_argument("--dtype", choices=_DTYPES, default="auto", help="model weights dtype (default: bf16 on GPU, fp32 on CPU)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-prompts", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens per prompt (truncation)")
    parser.add_argument(
        "--min-token-entropy", type=float, default=DEFAULT_MIN_TOKEN_ENTROPY,
        help=f"keep tokens whose next-token entropy is at least this many nats; 0 disables (default {DEFAULT_MIN_TOKEN_ENTROPY})",
    )
    parser.add_argument("--gram-tokens", type=int, default=None,
                        help="cap on the tokens per prompt of the prompt-mode statistics (default: all kept tokens)")
    parser.add_argument("--beta", type=float, default=1.0, help="ELSI-C CKA penalty weight")
    parser.add_argument("--one-per-compartment", action="store_true", help="ELSI-C: at most one layer per compartment")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/state.pt of an interrupted run")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=handler)


def load_model(name: str, device: str | None, dtype: str):
    """(model, tokenizer) for a hub id / folder or a llama2.c checkpoint; device "auto" means
    device_map="auto" (large models over several GPUs)."""
    import torch

    from ..llama2c import is_llama2c_checkpoint, load_llama2c, load_llama2c_tokenizer

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        torch_dtype = torch.bfloat16 if device != "cpu" else torch.float32
    else:
        torch_dtype = getattr(torch, dtype)
    if is_llama2c_checkpoint(name):
        model = load_llama2c(name, dtype=torch_dtype)
        return model.to("cpu" if device == "auto" else device), load_llama2c_tokenizer(name)
    if os.path.isfile(name):
        raise ValueError(f"--model: {name} is a file but not a llama2.c checkpoint; give a model folder or hub id")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"dtype": torch_dtype}
    if device == "auto":
        kwargs["device_map"] = "auto"
    model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    if device != "auto":
        model = model.to(device)
    return model, AutoTokenizer.from_pretrained(name)


def handler(args: argparse.Namespace) -> int:
    from ..analysis import analyze
    from ..prompts import load_prompts
    from ..serving import ENGINES

    model, tokenizer = load_model(args.model, args.device, args.dtype)
    prompts = load_prompts(args.prompts, max_prompts=args.max_prompts)
    os.makedirs(args.out, exist_ok=True)
    state_path = os.path.join(args.out, "state.pt")
    if os.path.exists(state_path) and not args.resume:
        os.remove(state_path)  # a fresh run; --resume keeps it
    report = analyze(
        model,
        tokenizer,
        prompts,
        m=args.m,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        min_token_entropy=args.min_token_entropy,
        gram_tokens=args.gram_tokens,
        beta=args.beta,
        one_per_compartment=args.one_per_compartment,
        state_path=state_path,
        progress=not args.no_progress,
        model_name=args.model,
    )
    report.to_json(os.path.join(args.out, "report.json"))
    plots = report.plot(args.out)

    configs = {}
    for method in ("elsi", "elsi-c"):
        for m in args.m:
            layers = report.select(method, m)
            for engine in ENGINES:
                key = f"{method}/m={m}/{engine}"
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        config = report.serving_config(engine, m=m, method=method)
                    configs[key] = {"layers": layers, "config": config, "notes": report.serving_notes(engine, m, method)}
                except ValueError as exc:  # e.g. h_0 in an output-of-layer engine
                    configs[key] = {"layers": layers, "config": None, "notes": [str(exc)]}
    with open(os.path.join(args.out, "serving_configs.json"), "w") as f:
        json.dump(configs, f, indent=1)

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
