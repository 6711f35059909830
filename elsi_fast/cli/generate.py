"""`elsi-fast generate`: text from a GGUF target on the native forward, with or without a draft.

The target runs on `targets.native_forward.NativeForward` (one native call per forward, the file's
own quantized blocks; docs/native-target.md). The text streams as it comes: token by token without
--draft, round by round with one (its tokens equal greedy decoding's). Decoding stops at the
file's end-of-generation tokens, the set llama.cpp stops at (`targets.loading.end_of_generation_ids`).
The end prints new tokens/s, tau with a draft, and the memory the target holds.
--compare-greedy also runs plain greedy decoding on every prompt, interleaved, and checks that the
outputs are equal (exit code 1 if one differs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .._infra.native_names import NATIVE_WEIGHT_DTYPES
from . import UsageError, check_lookup_args, one_line, positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text from a GGUF target on the native forward, optionally with a draft",
        description="Decodes greedily from a Llama-family or Gemma 3 GGUF target (a .gguf file or a catalog name) on "
        "elsi-fast's native forward, or speculatively with an EAGLE3 draft trained for it, and prints the "
        "text, new tokens/s and tau.",
    )
    parser.add_argument("--target", required=True, help="a .gguf file or catalog name (Llama family or Gemma 3)")
    parser.add_argument("--draft", default=None, help="an EAGLE3 draft folder trained for this target")
    parser.add_argument("-k", dest="k", type=positive_int, default=3, help="draft tokens per round (default 3)")
    parser.add_argument("--draft-dtype", choices=NATIVE_WEIGHT_DTYPES, default=None,
                        help="the draft's native weights (default: its own precision; int8 reads half of bf16's "
                             "bytes per step, docs/native-target.md)")
    parser.add_argument("--prompt-lookup", type=positive_int, default=None, metavar="N",
                        help="with --draft: propose what followed the latest earlier occurrence of the last N tokens "
                        "where there is one, the draft's tokens elsewhere (2 is a good N; docs/real-models.md, "
                        "\"Copying\")")
    parser.add_argument("--lookup-k", type=positive_int, default=None, metavar="K",
                        help="with --prompt-lookup: the most tokens a lookup round proposes (default: -k; 7 is a "
                        "good K: they cost no draft step, and 7 + 1 rows are one native forward)")
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", help="one prompt")
    prompts.add_argument("--prompts", help="a file of prompts: one per line, or JSON lines with a \"prompt\" key")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128, help="new tokens per prompt (default 128)")
    parser.add_argument("--raw", action="store_true", help="use the prompt as it is (default: the chat template)")
    parser.add_argument("--compare-greedy", action="store_true",
                        help="with --draft: also decode greedily, interleaved, and check the outputs are equal")
    parser.set_defaults(func=handler, check=check)


def _read_prompts(path: str) -> list[str]:
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--prompts: no such file: {path}")
    prompts = []
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (ValueError, KeyError, TypeError):
                raise UsageError(f"--prompts: line {number} of {path} is JSON without a \"prompt\" string") from None
        else:
            prompts.append(line)
    if not prompts:
        raise UsageError(f"--prompts: {path} holds no prompt")
    return prompts


def check(args: argparse.Namespace) -> None:
    from ..targets.gguf_weights import SUPPORTED_ARCHITECTURES
    from ..targets.loading import describe_source

    try:
        source = describe_source(args.target, "--target")
    except ValueError as exc:
        raise UsageError(one_line(exc)) from None
    if source.kind != "gguf":
        raise UsageError(f"--target: the native forward reads a .gguf file; {args.target} is a {source.kind}")
    if source.architecture not in (None, *SUPPORTED_ARCHITECTURES):
        raise UsageError(f"--target: {args.target} is a {source.architecture!r} model; the native forward runs "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)} GGUF files")
    args.target_path = source.path
    if args.draft is not None and not (Path(args.draft) / "config.json").is_file():
        raise UsageError(f"--draft: {args.draft} has no config.json; give an EAGLE3 draft folder")
    if args.compare_greedy and args.draft is None:
        raise UsageError("--compare-greedy: needs --draft (greedy decoding is what runs without one)")
    if args.draft_dtype is not None and args.draft is None:
        raise UsageError("--draft-dtype: needs --draft")
    if args.prompt_lookup is not None and args.draft is None:
        raise UsageError("--prompt-lookup: needs --draft (it proposes in front of the draft)")
    check_lookup_args(args)
    args.prompt_texts = [args.prompt] if args.prompt is not None else _read_prompts(args.prompts)


def handler(args: argparse.Namespace) -> int:
    import torch

    from ..decoding.native_target import (native_draft_decoder, native_greedy_generate, native_speculative_generate,
                                          target_embedding)
    from ..targets.loading import end_of_generation_ids, gguf_tokenizer
    from ..targets.native_forward import NativeForward

    tokenizer = gguf_tokenizer(args.target_path)
    if args.raw or not tokenizer.chat_template:
        prompts = [tokenizer(text).input_ids for text in args.prompt_texts]
    else:
        prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                      return_dict=True)["input_ids"]) for text in args.prompt_texts]
    capacity = max(len(p) for p in prompts) + args.max_new_tokens + args.k + 2
    native = NativeForward(args.target_path, capacity=capacity, num_threads=args.threads)
    draft = None
    if args.draft is not None:
        from .draft import read_target_draft

        module = read_target_draft(args, target_embedding(native))
        try:
            draft = native_draft_decoder(native, module, args.draft_dtype)
        except ValueError as exc:
            raise UsageError(one_line(exc).replace("draft_dtype=", "--draft-dtype ", 1)) from None
    eos = end_of_generation_ids(tokenizer)
    totals = {"tokens": 0, "seconds": 0.0, "greedy_seconds": 0.0, "accepted": 0, "rounds": 0}
    differ = 0
    for text, ids in zip(args.prompt_texts, prompts):
        print(f"### {text}", flush=True)
        start = time.perf_counter()
        stream = _Stream(tokenizer)
        if draft is None:
            out = native_greedy_generate(native, torch.tensor(ids), args.max_new_tokens, eos_token_id=eos,
                                         on_token=stream)
        else:
            result = native_speculative_generate(native, draft, torch.tensor(ids), args.max_new_tokens, args.k,
                                                 eos_token_id=eos, on_token=stream, prompt_lookup=args.prompt_lookup,
                                                 lookup_k=args.lookup_k)
            out = result.tokens
            totals["accepted"] += sum(result.accepted_lengths)
            totals["rounds"] += result.rounds
        print(flush=True)
        totals["seconds"] += time.perf_counter() - start
        totals["tokens"] += len(out)
        if args.compare_greedy:
            start = time.perf_counter()
            greedy = native_greedy_generate(native, torch.tensor(ids), args.max_new_tokens, eos_token_id=eos)
            totals["greedy_seconds"] += time.perf_counter() - start
            if not torch.equal(greedy, out):
                differ += 1
                print("(differs from greedy decoding)", flush=True)
    speed = totals["tokens"] / totals["seconds"]
    line = f"{len(prompts)} prompts, {totals['tokens']} new tokens: {speed:.1f} tokens/s ({native.num_threads} threads"
    if draft is not None:
        lookup = "" if args.prompt_lookup is None else f" behind a {args.prompt_lookup}-gram lookup" + \
            ("" if args.lookup_k is None else f" of up to {args.lookup_k} tokens")
        line += f", draft k={args.k}{lookup}, tau {(totals['accepted'] + totals['rounds']) / max(totals['rounds'], 1):.3f}"
    print(line + ")")
    print(f"memory: weights {native.weights.weight_bytes() / 2**20:.0f} MiB as mapped from the file, "
          f"{native.packed_weight_bytes() / 2**20:.0f} MiB of them packed for the products, KV cache "
          f"{native.kv_cache_bytes() / 2**20:.0f} MiB ({native.capacity} positions)")
    if args.compare_greedy:
        greedy_speed = totals["tokens"] / totals["greedy_seconds"]
        print(f"greedy decoding: {greedy_speed:.1f} tokens/s; the draft's speedup {speed / greedy_speed:.2f}x; "
              f"outputs equal on {len(prompts) - differ} of {len(prompts)} prompts")
    return 1 if differ else 0


class _Stream:
    """Prints the text of a growing id list as it grows (decoding the whole list each time keeps
    multi-token characters whole)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""

    def __call__(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[len(self.shown):])
            sys.stdout.flush()
            self.shown = text
