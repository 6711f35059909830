"""Which engine writes training data fastest here: `elsi_fast.training.regenerate` with llama.cpp's
`llama-server` (--slots parallel slots), elsi-fast's native forward (`--engine native`: up to 8
sequences batched per forward) and, where asked, transformers (`generate`, --transformers-batch
sequences, the model dequantized to --transformers-dtype; bf16 runs on AMX or AVX512-BF16 units),
on the same training instructions, greedy, <= 128 new tokens, --threads threads, after an untimed
warm-up of each, interleaved round by round, medians. The GGUF engines run the package's file
(SmolLM2: Q4_1; Gemma 3: Q4_K_M). A new tokens/s counts answer tokens only, the prompts' own
forwards included in the time. Reports new tokens/s against the --baseline engine and how many
answers equal its answers token for token (each engine quantizes its activations its own way, so
some differ). Rows: bench/results/regenerate_engines_cpu.jsonl, next to vllm_regenerate.py's.

    .venv/bin/python -m bench.integration.llamacpp_regenerate --prompts 48 --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

from bench.integration.llamacpp import VERSION, build_dir

ENGINES = ("transformers", "llama.cpp", "native")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a named real target (elsi_fast.targets.catalog)")
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=["llama.cpp", "native"])
    p.add_argument("--baseline", choices=ENGINES, default="llama.cpp")
    p.add_argument("--prompts", type=int, default=48, help="prompts per round (other ones each round)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--slots", type=int, default=16, help="llama-server's parallel slots (native: 8 sequences)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--transformers-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--transformers-batch", type=int, default=48)
    p.add_argument("--note", default="", help="conditions to record (e.g. another job paused)")
    args = p.parse_args(argv)
    if args.baseline not in args.engines:
        p.error(f"--baseline: {args.baseline} is not among --engines")

    import torch

    from bench.common import device_name, record, shared_data
    from elsi_fast.analysis.prompts import load_prompts
    from elsi_fast.decoding.native_batch import NativeBatchGenerator
    from elsi_fast.engines.llamacpp_server import LlamaServer
    from elsi_fast.targets import catalog
    from elsi_fast.targets.loading import end_of_generation_ids, load_model
    from elsi_fast.targets.native_forward import NativeForward
    from elsi_fast.training.regenerate import CONVERSATIONS_FILE, read_conversations, regenerate

    torch.set_num_threads(args.threads)
    gguf = catalog.resolve(args.model)
    model, tokenizer = load_model(args.model, device="cpu", dtype=args.transformers_dtype)
    pool = load_prompts(str(shared_data("prompts", "train_instructions.jsonl")))
    # A spread over the categories, other prompts each round (and for the warm-up): llama-server
    # keeps each slot's last prompt, and a prompt it saw before would skip its prefill.
    pool = pool[:: max(1, len(pool) // ((args.rounds + 1) * args.prompts))]
    rounds = [pool[(r + 1) * args.prompts:(r + 2) * args.prompts] for r in range(args.rounds)]
    if len(rounds[-1]) < args.prompts:
        p.error(f"--prompts: the training instructions hold fewer than {args.rounds + 1} x {args.prompts}")
    context = 1024 + 128
    servers = {"transformers": None}
    if "native" in args.engines:
        servers["native"] = NativeBatchGenerator(NativeForward(gguf, capacity=context, num_threads=args.threads,
                                                               sequences=8),
                                                 end_of_generation=end_of_generation_ids(tokenizer))
    rates: dict[str, list[float]] = {engine: [] for engine in args.engines}
    answers: dict[str, dict] = {}
    with LlamaServer(build_dir() / "build" / "bin" / "llama-server", gguf, slots=args.slots, context=context,
                     threads=args.threads) if "llama.cpp" in args.engines else contextlib.nullcontext() as server:
        servers["llama.cpp"] = server
        for engine in args.engines:  # untimed: the first requests page the file in and warm the server up
            folder = Path(tempfile.mkdtemp(prefix="regen-"))
            regenerate(model, tokenizer, pool[: args.prompts], folder, max_new_tokens=16,
                       batch_size=args.transformers_batch, progress=False, engine=engine, server=servers[engine])
            shutil.rmtree(folder)
        for r in range(args.rounds):
            for engine in args.engines if r % 2 == 0 else args.engines[::-1]:
                folder = Path(tempfile.mkdtemp(prefix="regen-"))
                summary = regenerate(model, tokenizer, rounds[r], folder, max_new_tokens=128,
                                     batch_size=args.transformers_batch, progress=False, engine=engine,
                                     server=servers[engine])
                rates[engine].append(summary["new_tokens_per_s"])
                answers.setdefault(engine, {}).update(
                    {x["id"]: x["response_ids"] for x in read_conversations(folder / CONVERSATIONS_FILE)})
                shutil.rmtree(folder)
                print(engine, f"{summary['new_tokens_per_s']:.1f} new tokens/s", flush=True)
    base = statistics.median(rates[args.baseline])
    for engine in args.engines:
        if engine == args.baseline:
            continue
        ours = statistics.median(rates[engine])
        equal = sum(answers[engine][i] == a for i, a in answers[args.baseline].items())
        prompts = len(answers[args.baseline])
        record("regenerate_engines_cpu", "regenerate_greedy", f"new_tokens_per_s/{engine}", ours, "tokens/s",
               device=device_name("cpu", args.threads), baseline=base, ratio=ours / base,
               params={"model": args.model, "file": Path(gguf).name, "baseline_engine": args.baseline,
                       "prompts": prompts, "prompts_per_round": args.prompts, "slots": args.slots, "native_sequences": 8,
                       "transformers_batch": args.transformers_batch, "transformers_dtype": args.transformers_dtype,
                       "max_new_tokens": 128, "threads": args.threads, "runs": rates,
                       "answers_equal": f"{equal}/{prompts}", "llama_cpp": f"llama-cpp-python {VERSION} sdist",
                       "loadavg": list(os.getloadavg()), "note": args.note})
        print(f"{engine} {ours:.1f} vs {args.baseline} {base:.1f} new tokens/s ({ours / base:.2f}x); "
              f"answers equal {equal}/{prompts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
