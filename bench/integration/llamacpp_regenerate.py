"""Which engine writes training data fastest here: `elsi_fast.training.regenerate` with transformers
(`generate`, batch 48, the dequantized fp32 model) against llama.cpp's `llama-server` (16 parallel
slots, the package's Q4_1 file), on the same training instructions, greedy, <= 128 new tokens,
2 threads, interleaved (transformers, llama.cpp, llama.cpp, transformers), medians. Reports new
tokens/s and how many of llama.cpp's greedy answers equal transformers' token for token (its
weights are quantized and its activations too, so some differ). Rows:
bench/results/regenerate_engines_cpu.jsonl, next to vllm_regenerate.py's.

    .venv/bin/python -m bench.integration.llamacpp_regenerate --prompts 48
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

from bench.integration.llamacpp import VERSION, build_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--note", default="", help="conditions to record (e.g. another job paused)")
    args = p.parse_args(argv)

    import torch

    from bench.common import device_name, record, shared_data
    from elsi_fast.analysis.prompts import load_prompts
    from elsi_fast.engines.llamacpp_server import LlamaServer
    from elsi_fast.targets import catalog
    from elsi_fast.targets.loading import load_model
    from elsi_fast.training.regenerate import CONVERSATIONS_FILE, read_conversations, regenerate

    torch.set_num_threads(args.threads)
    server_binary = build_dir() / "build" / "bin" / "llama-server"
    gguf = catalog.resolve("smollm2-135m-instruct")
    model, tokenizer = load_model("smollm2-135m-instruct", device="cpu", dtype="float32")
    prompts = load_prompts(str(shared_data("prompts", "train_instructions.jsonl")))
    prompts = prompts[:: max(1, len(prompts) // args.prompts)][: args.prompts]  # a spread over the categories
    rates: dict[str, list[float]] = {"transformers": [], "llama.cpp": []}
    answers: dict[str, dict] = {}
    with LlamaServer(server_binary, gguf, slots=args.slots, context=1024 + 128, threads=args.threads) as server:
        for engine in ("transformers", "llama.cpp", "llama.cpp", "transformers"):
            folder = Path(tempfile.mkdtemp(prefix="regen-"))
            summary = regenerate(model, tokenizer, prompts, folder, max_new_tokens=128, batch_size=48,
                                 progress=False, engine=engine, server=server if engine == "llama.cpp" else None)
            rates[engine].append(summary["new_tokens_per_s"])
            answers[engine] = {r["id"]: r["response_ids"] for r in read_conversations(folder / CONVERSATIONS_FILE)}
            shutil.rmtree(folder)
            print(engine, f"{summary['new_tokens_per_s']:.1f} new tokens/s")
    ours, base = statistics.median(rates["llama.cpp"]), statistics.median(rates["transformers"])
    equal = sum(answers["llama.cpp"][i] == a for i, a in answers["transformers"].items())
    record("regenerate_engines_cpu", "regenerate_greedy", "new_tokens_per_s/llama.cpp", ours, "tokens/s",
           device=device_name("cpu", args.threads), baseline=base, ratio=ours / base,
           params={"model": "SmolLM2-135M-Instruct (llama.cpp: the Q4_1 file; transformers: dequantized fp32)",
                   "prompts": len(prompts), "slots": args.slots, "transformers_batch": 48, "max_new_tokens": 128,
                   "runs": rates, "answers_equal": f"{equal}/{len(prompts)}", "llama_cpp": f"llama-cpp-python {VERSION} sdist",
                   "loadavg": list(os.getloadavg()), "note": args.note})
    print(f"llama.cpp {ours:.1f} vs transformers {base:.1f} new tokens/s ({ours / base:.2f}x); "
          f"answers equal {equal}/{len(prompts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
