"""`elsi-fast regenerate`: the target answers the training prompts; conversations for `train-draft --data`."""

from __future__ import annotations

import argparse
import contextlib
import math
import os

from . import UsageError, one_line, positive_int
from .analyze import check_device, check_model, check_out_folder
from .draft import add_target_arguments, load_target

# elsi_fast.training.regenerate.CONVERSATIONS_FILE, repeated because checks and Ctrl-C hints must not import torch.
CONVERSATIONS_FILE = "conversations.jsonl"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "regenerate",
        help="let the target answer training prompts (chat template, batched): the anchors' regenerated data",
        description="The target answers every prompt of PROMPTS with its chat template (greedy, or sampled with "
        f"--temperature), in batches; each answer is appended to OUT/{CONVERSATIONS_FILE} with its exact tokens. "
        "A rerun with the same OUT continues with the prompts not yet answered (Ctrl-C finishes the batch under way).",
    )
    add_target_arguments(parser)
    parser.add_argument("--prompts", required=True, nargs="+",
                        help="prompts JSONL (e.g. train_instructions.jsonl), text file, or folder; several are "
                        "answered in the order given (their prompt ids must not repeat)")
    parser.add_argument("--out", required=True, help=f"output folder ({CONVERSATIONS_FILE} and regenerate.json)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=256, help="answer length cap (default 256)")
    parser.add_argument("--max-prompt-tokens", type=positive_int, default=1024,
                        help="prompts are cut to their last this many tokens (default 1024)")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="prompts generated at once (default 16)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampled")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    parser.add_argument("--max-prompts", type=positive_int, default=None, help="only the first N prompts")
    parser.add_argument("--engine", choices=("transformers", "vllm", "llama.cpp", "native"), default="transformers",
                        help="who generates: transformers' generate (default), vLLM's offline engine (about 2x "
                        "faster on a CPU with the same greedy answers, from its own environment, --vllm-python), "
                        "llama.cpp's llama-server on the target's GGUF file (--llama-server) or elsi-fast's native "
                        "forward on that file, up to 8 sequences batched per forward (the quantized weights of both "
                        "can answer differently from the dequantized model); another engine may continue a folder")
    parser.add_argument("--llama-server", default=None, metavar="PATH",
                        help="--engine llama.cpp: the llama-server binary (python -m bench.integration.llamacpp build)")
    parser.add_argument("--slots", type=positive_int, default=None,
                        help="--engine llama.cpp: parallel sequences of llama-server (default 16); --engine native: "
                        "sequences batched per forward (1..8, default 8)")
    parser.add_argument("--vllm-python", default=None,
                        help="--engine vllm: the Python of the vLLM environment (default: $ELSI_FAST_VLLM_PYTHON, "
                        "else the interpreter of `vllm` on PATH)")
    parser.add_argument("--self-instruct", type=positive_int, default=None, metavar="N",
                        help="first let the target write N instructions itself (Magpie: sampled from its chat "
                        "template's user-turn prefix, duplicates and anything near --eval-prompts dropped) into "
                        "OUT/instructions.jsonl, then answer them together with --prompts")
    parser.add_argument("--instruction-temperature", type=float, default=1.0,
                        help="--self-instruct: temperature of the sampled user turns (default 1.0, as Magpie)")
    parser.add_argument("--instruction-openings", default=None, metavar="FILE",
                        help="--self-instruct: start the sampled user turns with these first words, one line each, "
                        "a batch each in turn ('builtin': 28 task openings, from writing and role-play to code, "
                        "summaries and translation); a folder sampled without them continues with them")
    parser.add_argument("--corpus-tasks", type=positive_int, default=None, metavar="N",
                        help="also answer N document tasks built from --corpus paragraphs (summarize, list the key "
                        "points, extract names and numbers, simplify, a headline, a question about the article; "
                        "anything near --eval-prompts dropped) written to OUT/corpus_tasks.jsonl")
    parser.add_argument("--corpus-documents", type=positive_int, default=None, metavar="N",
                        help="also answer N tasks on long documents, consecutive --corpus paragraphs of one article "
                        "joined into 250-450 words (summarize, key points, extract, a question placed after the "
                        "text, as in RAG prompts), written to OUT/corpus_documents.jsonl")
    parser.add_argument("--corpus-copies", type=positive_int, default=None, metavar="N",
                        help="also answer N copy tasks, a --corpus paragraph to repeat word for word (greedy "
                        "targets copy from their prompt; a draft learns it from these), written to "
                        "OUT/corpus_copies.jsonl")
    parser.add_argument("--corpus", nargs="+", default=None, metavar="TEXT",
                        help="--corpus-tasks, --corpus-documents, --corpus-copies: plain-text corpora (paragraphs between blank "
                        "lines; WikiText as it ships)")
    parser.add_argument("--eval-prompts", nargs="+", default=None, metavar="JSONL",
                        help="--self-instruct, --corpus-tasks, --corpus-documents, --corpus-copies: evaluation prompt files "
                        "(Spec-Bench, MT-bench) that the prompts must stay away from (a shared word 8-gram or a near "
                        "duplicate of a turn drops one)")
    parser.add_argument("--restore", default=None, metavar="ANSWERS_JSON",
                        help="first rebuild OUT from kept answers (export_answers output, .json or .json.gz) made "
                        "with these same settings and prompts, on this or another machine, then continue")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=handler, check=check, interrupted=interrupted)


def check(args: argparse.Namespace) -> None:
    from ..analysis.prompts import load_prompts

    check_model(args.target, "--target")
    check_device(args.device)
    check_out_folder(args.out)
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--temperature: must be a number >= 0 (0: greedy), got {args.temperature}")
    if args.engine == "vllm":
        from ..engines.vllm_env import environment_python

        try:
            args.vllm_python = environment_python(args.vllm_python, "--vllm-python")
        except ValueError as exc:
            raise UsageError(one_line(exc)) from None
    elif args.vllm_python is not None:
        raise UsageError("--vllm-python: only with --engine vllm")
    if args.engine == "llama.cpp":
        if args.llama_server is None or not (os.path.isfile(args.llama_server) and os.access(args.llama_server, os.X_OK)):
            raise UsageError(f"--llama-server: --engine llama.cpp needs the llama-server binary, got {args.llama_server}")
    elif args.llama_server is not None:
        raise UsageError("--llama-server: only with --engine llama.cpp")
    if args.engine in ("llama.cpp", "native"):
        from ..targets.catalog import is_catalog_name

        if not (is_catalog_name(args.target) or str(args.target).endswith(".gguf")):
            raise UsageError(f"--engine: {args.engine} runs a GGUF target (a .gguf file or a named real target)")
        if args.engine == "native" and args.slots is not None and args.slots > 8:
            raise UsageError(f"--slots: the native forward batches 1..8 sequences, got {args.slots}")
        args.slots = args.slots or (16 if args.engine == "llama.cpp" else 8)
    elif args.slots is not None:
        raise UsageError("--slots: only with --engine llama.cpp or native")
    try:
        args.prompt_list = [prompt for path in args.prompts for prompt in load_prompts(path)][: args.max_prompts]
    except (ValueError, FileNotFoundError) as exc:
        raise UsageError(f"--prompts: {one_line(exc).removeprefix('prompts: ')}") from None
    ids = [prompt.id for prompt in args.prompt_list if prompt.id is not None]
    if len(args.prompts) > 1 and len(set(ids)) != len(ids):
        raise UsageError("--prompts: the files' prompt ids repeat; each prompt needs its own id to be resumable")
    if args.restore is not None:
        if not os.path.isfile(args.restore):
            raise UsageError(f"--restore: no such file: {args.restore}")
        if os.path.isfile(os.path.join(args.out, CONVERSATIONS_FILE)):
            raise UsageError(f"--restore: {args.out} already holds conversations; restore into a new --out")
        import gzip
        import json

        try:
            with (gzip.open if args.restore.endswith(".gz") else open)(args.restore, "rt") as f:
                args.restored = json.load(f)
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise UsageError(f"--restore: not a JSON export of answers: {one_line(exc)}") from None
        if not isinstance(args.restored, dict) or not isinstance(args.restored.get("answers"), list) \
                or not isinstance(args.restored.get("settings"), dict):
            raise UsageError("--restore: expected {\"settings\": ..., \"answers\": [...]} (export_answers output)")
    corpus_users = [flag for flag, n in (("--corpus-tasks", args.corpus_tasks),
                                         ("--corpus-documents", args.corpus_documents),
                                         ("--corpus-copies", args.corpus_copies)) if n is not None]
    if args.corpus is not None and not corpus_users:
        raise UsageError("--corpus: goes with --corpus-tasks, --corpus-documents or --corpus-copies (the corpora "
                         "their prompts are built from)")
    if args.corpus is None and corpus_users:
        raise UsageError(f"{corpus_users[0]}: needs --corpus, the corpora to build them from")
    if args.corpus:
        from ..training.corpus_tasks import DOCUMENT_WORDS, MAX_WORDS, MIN_WORDS, documents, passages

        for path in args.corpus:
            if not os.path.isfile(path):
                raise UsageError(f"--corpus: no such file: {path}")
            # before the target loads: a typo'd file costs no model load
            if (args.corpus_tasks is not None or args.corpus_copies is not None) and not passages(path):
                raise UsageError(f"--corpus: no paragraph of {MIN_WORDS}-{MAX_WORDS} words in {path}")
            if args.corpus_documents is not None and not documents(path):
                raise UsageError(f"--corpus: no document of {DOCUMENT_WORDS[0]}-{DOCUMENT_WORDS[1]} words in {path}")
    args.openings = None
    if args.instruction_openings is not None:
        if args.self_instruct is None:
            raise UsageError("--instruction-openings: only with --self-instruct")
        args.openings = _openings(args.instruction_openings)
    if args.self_instruct is None and not corpus_users:
        if args.eval_prompts is not None:
            raise UsageError("--eval-prompts: only with --self-instruct, --corpus-tasks, --corpus-documents or "
                             "--corpus-copies")
        return
    if not (math.isfinite(args.instruction_temperature) and args.instruction_temperature > 0):
        raise UsageError(f"--instruction-temperature: must be a number > 0, got {args.instruction_temperature}")
    if not args.eval_prompts:
        which = "--self-instruct" if args.self_instruct is not None else corpus_users[0]
        raise UsageError(f"--eval-prompts: {which} needs the evaluation prompt files (e.g. Spec-Bench and "
                         "MT-bench JSONL) so that no prompt it writes comes near them")
    from ..training.self_instruct import evaluation_texts

    for path in args.eval_prompts:
        if not os.path.isfile(path):
            raise UsageError(f"--eval-prompts: no such file: {path}")
    try:
        args.eval_texts = evaluation_texts(args.eval_prompts)
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"--eval-prompts: not a prompts JSONL: {one_line(exc)}") from None
    if not args.eval_texts:
        raise UsageError("--eval-prompts: the files hold no turns")


def interrupted(args: argparse.Namespace) -> str:
    path = os.path.join(args.out, CONVERSATIONS_FILE)
    if os.path.isfile(path):
        return f"the answers so far are in {path}: rerun the same command to continue with the rest"
    return "no batch had finished: rerun the command"


def handler(args: argparse.Namespace) -> int:
    model, tokenizer = load_target(args)
    with contextlib.ExitStack() as stack:
        server = None
        if args.engine in ("llama.cpp", "native"):
            from ..targets.catalog import is_catalog_name, resolve

            gguf = resolve(args.target, "--target") if is_catalog_name(args.target) else args.target
            context = args.max_prompt_tokens + args.max_new_tokens
            if args.engine == "llama.cpp":
                from ..engines.llamacpp_server import LlamaServer

                server = stack.enter_context(LlamaServer(args.llama_server, gguf, slots=args.slots, context=context,
                                                         threads=args.threads))
            else:
                from ..decoding.native_batch import NativeBatchGenerator
                from ..targets.loading import end_of_generation_ids
                from ..targets.native_forward import NativeForward

                server = NativeBatchGenerator(NativeForward(gguf, capacity=context, num_threads=args.threads,
                                                            sequences=args.slots),
                                              end_of_generation=end_of_generation_ids(tokenizer))
        return _generate_all(args, model, tokenizer, server)


def _openings(value: str) -> list[str]:
    """--instruction-openings: the built-in list, or a text file's non-empty lines."""
    from ..training.self_instruct import OPENINGS

    if value == "builtin":
        return list(OPENINGS)
    if not os.path.isfile(value):
        raise UsageError(f"--instruction-openings: no such file: {value} (or 'builtin')")
    try:
        with open(value, encoding="utf-8") as f:
            lines = [line.strip() for line in f if line.strip()]
    except UnicodeDecodeError:
        raise UsageError(f"--instruction-openings: {value} is not UTF-8 text") from None
    if not lines:
        raise UsageError(f"--instruction-openings: {value} holds no opening")
    return lines


def _generate_all(args: argparse.Namespace, model, tokenizer, server) -> int:
    from ..analysis.prompts import load_prompts
    from ..training.corpus_tasks import write_corpus_tasks
    from ..training.regenerate import regenerate

    prompts = args.prompt_list
    if args.self_instruct is not None:
        from ..training.self_instruct import self_instruct

        try:
            written = self_instruct(model, tokenizer, args.out, args.self_instruct, eval_texts=args.eval_texts,
                                    temperature=args.instruction_temperature, batch_size=args.batch_size,
                                    seed=args.seed, openings=args.openings, progress=not args.no_progress,
                                    server=server)
        except ValueError as exc:
            raise UsageError(one_line(exc)) from None
        dropped = ", ".join(f"{k} {v}" for k, v in sorted(written["dropped"].items())) or "none"
        print(f"self-instruct: {written['kept']} instructions kept of {written['sampled']} sampled (dropped: "
              f"{dropped}); {written['new_tokens']} new tokens now ({written['new_tokens_per_s']:.1f} tokens/s); "
              f"{written['path']}")
        prompts = prompts + load_prompts(written["path"])
    for n, kind, label in ((args.corpus_tasks, "paragraphs", "corpus tasks: {} document tasks"),
                           (args.corpus_documents, "documents", "corpus documents: {} tasks on long documents"),
                           (args.corpus_copies, "copies", "corpus copies: {} passages to repeat")):
        if n is None:
            continue
        try:
            path = write_corpus_tasks(args.corpus, args.out, n, eval_prompts=args.eval_prompts, seed=args.seed,
                                      kind=kind)
        except ValueError as exc:
            raise UsageError(f"--corpus: {one_line(exc).removeprefix('corpus: ')}") from None
        tasks = load_prompts(str(path))
        print(f"{label.format(len(tasks))} from {len(args.corpus)} corpora; {path}")
        prompts = prompts + tasks
    if args.restore is not None:
        from ..training.regenerate import restore_answers

        try:
            written = restore_answers(model, tokenizer, prompts, args.out, args.restored,
                                      max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                                      batch_size=args.batch_size, temperature=args.temperature, seed=args.seed,
                                      engine=args.engine)
        except ValueError as exc:
            raise UsageError(f"--restore: {one_line(exc).removeprefix('exported: ')}") from None
        print(f"restored {written} answers from {args.restore}")
    summary = regenerate(model, tokenizer, prompts, args.out, max_new_tokens=args.max_new_tokens,
                         max_prompt_tokens=args.max_prompt_tokens, batch_size=args.batch_size,
                         temperature=args.temperature, seed=args.seed, progress=not args.no_progress,
                         engine=args.engine, vllm_python=args.vllm_python, server=server)
    print(f"answered {summary['answered_now']} prompts now ({summary['prompts']} in all): {summary['new_tokens']} new "
          f"tokens in {summary['seconds']:.0f} s ({summary['new_tokens_per_s']:.1f} tokens/s); {summary['path']}")
    return 0
