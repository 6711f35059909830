"""`elsi-fast serve` run for real: the one command starts llama.cpp's or vLLM's server with a trained
draft, Spec-Bench prompts go through its HTTP API, and the acceptance the server reports is
compared with elsi-fast's replayed tau on the same prompts and k (bench/draft_experiment.py's
evaluation continuations and their cache).

    .venv/bin/python -m bench.integration.serve_check --engine llama.cpp --k 3 \
        --draft runs/draft-experiment/smollm2-135m-instruct/cells/elsi-m1-seed0-claims
    .venv/bin/python -m bench.integration.serve_check --engine vllm --k 3 --draft ...

Prompts go as token ids (the target's chat-formatted prompt, exactly as elsi-fast saw it), greedy,
`max_tokens` = the length of the target's recorded greedy continuation (so the rounds are
elsi-fast's), EOS ignored. llama-server's `timings` give the draft tokens and the accepted ones;
vLLM's `/metrics` the drafts (rounds) and accepted tokens. vLLM's dequantized fp32 target must
reproduce the recorded greedy text; llama.cpp's Q4_1 target computes in ggml's precision, so only
its acceptance is compared (within 5%). Rows: bench/results/serve_check_cpu.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

from bench.integration.vllm_serve import VLLM_CPU_ENV

EXPERIMENT = ROOT / "runs" / "draft-experiment" / "smollm2-135m-instruct"
RESULTS = "serve_check_cpu"


def _http(url: str, body: dict | None = None, timeout: float = 600) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def wait_ready(url: str, server: subprocess.Popen, seconds: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode} before it was ready")
        try:
            _http(url + "/health", timeout=5)
            return time.monotonic() - start
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"the server was not ready after {seconds:.0f} s")


def spec_counters(url: str) -> dict[str, float]:
    """vLLM's Prometheus counters of speculative decoding (summed over label sets)."""
    counters: dict[str, float] = {}
    for line in _http(url + "/metrics").decode().splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total"):
            counters[name] = counters.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return counters


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True, choices=("llama.cpp", "vllm"))
    p.add_argument("--draft", required=True)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--per-category", type=int, default=1, help="Spec-Bench prompts per category")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--experiment", default=str(EXPERIMENT))
    args = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    from bench.common import cpu_model, first_per_category, record
    from elsi_fast.decoding.evaluation import pooled_tau, replay_runs_per_k
    from elsi_fast.draft import read_draft
    from elsi_fast.targets import catalog
    from elsi_fast.targets.loading import dequantized_folder, load_model
    from elsi_fast.training.feature_cache import open_cache
    from elsi_fast.training.regenerate import read_conversations

    experiment = Path(args.experiment)
    records = read_conversations(experiment / "eval" / "conversations.jsonl")
    chosen = first_per_category(records, args.per_category)
    target = catalog.resolve("smollm2-135m-instruct")
    folder = dequantized_folder(target)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    embedding = load_model(str(folder), device="cpu", dtype="float32")[0].get_input_embeddings().weight.detach()
    draft = read_draft(args.draft, embed_tokens=embedding).eval()
    ours = pooled_tau(replay_runs_per_k(draft, records, open_cache(experiment / "cache-eval"), [args.k],
                                        only=chosen)[args.k])["all"]

    command = [sys.executable, "-m", "elsi_fast", "serve", "--draft", args.draft, "--engine", args.engine,
               "--target", str(target), "-k", str(args.k), "--port", str(args.port), "--threads", str(args.threads)]
    env = dict(os.environ)
    if args.engine == "llama.cpp":
        from bench.integration.llamacpp import binary

        command += ["--binary", str(binary("llama-server")), "--", "-c", "2048", "--no-warmup"]
    else:
        command += ["--binary", str(HERE / ".venv-vllm" / "bin" / "vllm"), "--", "--max-model-len", "2048",
                    "--max-num-seqs", "1", "--dtype", "float32"]
        env.update(VLLM_CPU_ENV, OMP_NUM_THREADS=str(args.threads))
    url = f"http://127.0.0.1:{args.port}"
    log_path = HERE / "out" / f"serve-{args.engine}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            ready_s = wait_ready(url, server, 900)
            before = spec_counters(url) if args.engine == "vllm" else {}
            drafted = accepted = generated = equal = 0
            seconds = 0.0
            for i in chosen:
                prompt, budget = records[i]["prompt_ids"], len(records[i]["response_ids"])
                start = time.monotonic()
                if args.engine == "llama.cpp":
                    out = json.loads(_http(url + "/completion", {"prompt": prompt, "n_predict": budget, "temperature": 0,
                                                                 "top_k": 1, "ignore_eos": True, "cache_prompt": False}))
                    timings = out["timings"]
                    drafted += timings.get("draft_n", 0)
                    accepted += timings.get("draft_n_accepted", 0)
                    generated += timings["predicted_n"]
                    seconds += timings["predicted_ms"] / 1000
                else:
                    out = json.loads(_http(url + "/v1/completions", {"model": str(folder), "prompt": prompt,
                                                                     "max_tokens": budget, "temperature": 0,
                                                                     "ignore_eos": True}))
                    seconds += time.monotonic() - start
                    text = out["choices"][0]["text"]
                    generated += out["usage"]["completion_tokens"]
                    equal += text == tokenizer.decode(records[i]["response_ids"], skip_special_tokens=True)
            if args.engine == "vllm":
                after = spec_counters(url)
                rounds = after["vllm:spec_decode_num_drafts_total"] - before.get("vllm:spec_decode_num_drafts_total", 0)
                accepted = after["vllm:spec_decode_num_accepted_tokens_total"] - before.get(
                    "vllm:spec_decode_num_accepted_tokens_total", 0)
                theirs = 1 + accepted / rounds
            else:  # each verification round yields its accepted tokens + 1; the first token is the prefill's
                rounds = generated - len(chosen) - accepted
                theirs = (generated - len(chosen)) / rounds
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGTERM)
                server.wait(timeout=60)

    speed = generated / seconds
    params = {"engine": args.engine, "draft": args.draft, "layers": list(draft.config.aux_layer_ids), "k": args.k,
              "target": "SmolLM2-135M-Instruct" + (" Q4_1" if args.engine == "llama.cpp" else " dequantized fp32"),
              "prompts": len(chosen), "command": command, "ready_seconds": round(ready_s, 1), "rounds": rounds,
              "accepted": accepted, "drafted": drafted or None, "generated": generated,
              "elsi_fast_replayed_tau": ours, "acceptance_ratio": theirs / ours, "threads": args.threads,
              "greedy_equal": f"{equal}/{len(chosen)}" if args.engine == "vllm" else None, "loadavg": os.getloadavg()}
    device = f"{cpu_model()} ({args.threads} threads)"
    record(RESULTS, "elsi_fast_serve", "mean_acceptance_length", theirs, "tokens/round", device=device,
           baseline=ours, ratio=theirs / ours, params=params)
    record(RESULTS, "elsi_fast_serve", "decode_tokens_per_s", speed, "tokens/s", device=device, params=params)
    print(f"{args.engine} via `elsi-fast serve` (ready in {ready_s:.0f} s): mean acceptance length {theirs:.3f} vs "
          f"elsi-fast tau {ours:.3f} ({theirs / ours:.3f}); {speed:.1f} tokens/s"
          + (f"; greedy text equal {equal}/{len(chosen)}" if args.engine == "vllm" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
