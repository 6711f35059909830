"""Memory of EAGLE3 drafts on the real target, measured in each engine on the CPU: vLLM, llama.cpp, elsi-fast.

    .venv/bin/python -m bench.integration.memory --drafts \\
        runs/draft-experiment/smollm2-135m-instruct/cells/{elsi-m1,eagle3-m3}-seed0-claims

Each engine serves the same Spec-Bench prompts (`vllm_real.spec_bench_prompts`: chat template,
--per-category of each of --categories; greedy, --max-new-tokens) in a fresh process, without a draft
and with each draft at k = --k. Per engine and draft:

* draft_file_bytes: the file the engine loads: the draft folder's model.safetensors (vLLM, elsi-fast)
  or its GGUF export in --gguf-dtype (llama.cpp, `llamacpp.export_draft`: a draft of m < 3 is written
  as its 3-id equivalent, so an m=1 file is as large as an m=3 one);
* draft_memory_bytes: the draft's weights in the serving process beyond the target's: in vLLM the
  drafter's tensors not shared with the target (read in its worker), in llama.cpp the draft's model
  buffer as llama.cpp reports it, in elsi-fast the `Eagle3Draft` module plus the `NativeDraftDecoder`'s
  packed copy in --native-dtype (the draft's KV cache is in the row's params);
* capture_bytes_per_token: the target states handed to the draft per token, m x d x 4 (float32 states
  in all three: vLLM and elsi-fast serve the float32 target, ggml's activations are F32; llama.cpp
  captures 3 states whatever m);
* peak_rss_bytes: the serving process's peak resident set (wait4's ru_maxrss), against the same engine
  without a draft: vLLM without speculation, llama-speculative-simple with n-gram speculation (it has no
  draftless mode), elsi-fast's `greedy_generate`.

Rows: bench/results/memory_cpu.jsonl. Needs vllm_serve.py's vLLM environment (created on first use)
and llamacpp.py's build (built on first use: minutes). See README.md beside this file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from bench.integration import llamacpp, vllm_real, vllm_serve

RESULTS = "memory_cpu"
ENGINES = ("vllm", "llamacpp", "elsi-fast")
STATE_BYTES = 4  # one float32 element of a captured target state (see the docstring)
METRICS = ("draft_file_bytes", "draft_memory_bytes", "capture_bytes_per_token")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", nargs="?", default="measure", choices=("measure", "worker"),
                   help="`worker` is the elsi-fast serving process that `measure` starts")
    p.add_argument("--drafts", nargs="+", default=[], help="trained EAGLE3 draft folders of the target")
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    p.add_argument("--model", default="smollm2-135m-instruct", help="the named target (elsi_fast.targets.catalog)")
    p.add_argument("--k", type=int, default=3, help="draft tokens per round")
    p.add_argument("--prompts", help="Spec-Bench-style JSONL (default: the shared data's Spec-Bench)")
    p.add_argument("--categories", nargs="+", help="only these categories of --prompts (default: all)")
    p.add_argument("--per-category", type=int, default=1, help="prompts per category")
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--native-dtype", choices=("fp32", "bf16", "int8"), default="fp32",
                   help="elsi-fast: the NativeDraftDecoder's weights")
    p.add_argument("--gguf-dtype", choices=llamacpp.GGUF_DTYPES, default="f16",
                   help="llama.cpp: the draft file's weights")
    p.add_argument("--threads", type=int, default=1, help="threads of every serving process (shared CPU: 1)")
    p.add_argument("--out", default=str(vllm_serve.HERE / "out" / "memory"), help="working folder")
    p.add_argument("--venv", default=str(vllm_serve.HERE / ".venv-vllm"), help="the vLLM environment")
    p.add_argument("--job", help="`worker` only: job JSON written by `measure`")
    return p.parse_args(argv)


def _name(path: str | None) -> str:
    return Path(path).name if path else "no-draft"


def measure_vllm(args: argparse.Namespace, target: Path, prompts: list[list[int]], drafts: dict, width: int) -> dict:
    """{draft folder or None: its vLLM run}: the serving subprocess of `vllm_real.serve_real`."""
    python = vllm_serve.ensure_vllm_env(Path(args.venv))
    runs = {}
    for path in [None, *drafts]:
        served = vllm_real.serve_real(python, target, prompts, args.max_new_tokens, args.k,
                                       Path(args.out) / "vllm" / _name(path), args.threads, path, args.k if path else 0)
        run = {"peak_rss_bytes": served["peak_rss_bytes"], "hwm_after_init_bytes": served["hwm_after_init_bytes"],
               "vllm_version": served["vllm_version"], "tokens_per_s": vllm_real.tokens_per_s(served)}
        if path:
            m = len(drafts[path].config.aux_layer_ids)
            run.update(draft_file_bytes=_weights_bytes(path), draft_memory_bytes=served["draft_tensor_bytes"],
                       capture_bytes_per_token=m * width * STATE_BYTES)
        runs[path] = run
    return runs


def measure_llamacpp(args: argparse.Namespace, gguf_target: Path, texts: list[str], drafts: dict, width: int) -> dict:
    """{draft folder or None: its llama.cpp runs}: one llama-speculative-simple process per prompt,
    the peak over them."""
    from elsi_fast.engines.layer_ids import llamacpp_layer_ids

    llamacpp.build()
    work = Path(args.out) / "llamacpp"
    work.mkdir(parents=True, exist_ok=True)

    def serve(spec_args: list[str]) -> dict:
        runs = [llamacpp.speculative_simple(gguf_target, text, spec_args, args.max_new_tokens, args.threads)[1]
                for text in texts]
        return {"peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs), "runs": runs}

    mode, spec_args = llamacpp.NGRAM_MODES[0]
    out = {None: {**serve(spec_args), "speculation": mode}}
    for path, draft in drafts.items():
        gguf = llamacpp.export_draft(draft, Path(path).name, args.gguf_dtype, gguf_target, work)
        run = serve(["-md", str(gguf), "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(args.k)])
        served_ids = llamacpp_layer_ids(draft.config.aux_layer_ids)
        # the allocation lines come target first, then the draft
        first = run["runs"][0]
        out[path] = {**run, "draft_file_bytes": gguf.stat().st_size, "gguf_dtype": args.gguf_dtype,
                     "draft_memory_bytes": round(first["model_buffer_mib"][1] * 2**20),
                     "draft_kv_bytes": round(first["kv_buffer_mib"][1] * 2**20), "served_ids": served_ids,
                     "capture_bytes_per_token": len(served_ids) * width * STATE_BYTES}
    return out


def measure_elsi_fast(args: argparse.Namespace, prompts: list[list[int]], drafts: dict, width: int) -> dict:
    """{draft folder or None: its elsi-fast run}: `worker` in a fresh subprocess of this environment."""
    from bench.common import run_peak_rss

    work = Path(args.out) / "elsi-fast"
    work.mkdir(parents=True, exist_ok=True)
    out = {}
    for path in [None, *drafts]:
        result, job_path = work / f"{_name(path)}.json", work / f"{_name(path)}.job.json"
        job_path.write_text(json.dumps({"model": args.model, "draft": path, "k": args.k, "prompts": prompts,
                                        "max_new_tokens": args.max_new_tokens, "native_dtype": args.native_dtype,
                                        "threads": args.threads, "result": str(result)}))
        cmd = [sys.executable, "-m", "bench.integration.memory", "worker", "--job", str(job_path)]
        print("+ " + " ".join(cmd), flush=True)
        done, peak_rss = run_peak_rss(cmd, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        if done.returncode != 0:
            raise RuntimeError(f"the elsi-fast worker failed (exit {done.returncode}) on {job_path}")
        run = {"peak_rss_bytes": peak_rss, **json.loads(result.read_text())}
        if path:
            m = len(drafts[path].config.aux_layer_ids)
            run.update(draft_file_bytes=_weights_bytes(path), capture_bytes_per_token=m * width * STATE_BYTES)
        out[path] = run
    return out


def worker(job_path: str) -> None:
    """The elsi-fast serving process: the target, and with a draft its native decoder, on the job's prompts."""
    job = json.loads(Path(job_path).read_text())
    from elsi_fast._infra.threads import configure

    configure(job["threads"])
    import torch

    from elsi_fast.decoding.speculative import (draft_positions_needed, greedy_generate, native_decoder_for,
                                                speculative_generate)
    from elsi_fast.targets.loading import load_model

    model, _ = load_model(job["model"], device="cpu", dtype="float32", progress=False)
    prompts, budget, k = [torch.tensor(ids) for ids in job["prompts"]], job["max_new_tokens"], job["k"]
    result: dict = {}
    if job["draft"] is None:
        for ids in prompts:
            greedy_generate(model, ids, budget)
    else:
        draft = vllm_real.load_draft(job["draft"], model, job["model"])
        max_len = draft_positions_needed(max(len(ids) for ids in prompts), budget, k)
        decoder = native_decoder_for(draft, max_len, draft_dtype=job["native_dtype"])
        runs = [speculative_generate(model, decoder, ids, budget, k) for ids in prompts]
        # the decoder keeps the module (its torch prefill) next to its own packed copy of the matrices
        module = sum(t.numel() * t.element_size() for t in draft.state_dict().values())
        config = draft.config
        rounds = sum(r.rounds for r in runs)
        result = {"draft_memory_bytes": module + decoder.weight_bytes, "draft_module_bytes": module,
                  "native_weight_bytes": decoder.weight_bytes, "native_dtype": job["native_dtype"],
                  "draft_kv_bytes": 2 * config.num_key_value_heads * max_len * config.head_dim * 4,
                  "tau": (sum(sum(r.accepted_lengths) for r in runs) + rounds) / rounds,
                  "draft_backend": runs[0].draft_backend}
    Path(job["result"]).write_text(json.dumps(result))


def _weights_bytes(folder: str) -> int:
    """Bytes of the weights file(s) vLLM and elsi-fast load from a draft folder (not its training state)."""
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def write_rows(engine: str, runs: dict, drafts: dict, common: dict, device: str) -> list[dict]:
    """One peak-RSS row without a draft; per draft the METRICS rows and its peak RSS against that."""
    from bench.common import record

    plain = runs[None]["peak_rss_bytes"]
    params = {**common, "engine": engine}
    rows = [record(RESULTS, "serving_memory", "peak_rss_bytes", plain, "bytes", device=device,
                   params={**params, "draft": None, **runs[None], "loadavg": os.getloadavg()})]
    for path, draft in drafts.items():
        run = runs[path]
        layers = list(draft.config.aux_layer_ids)
        facts = {**params, "draft": path, "m": len(layers), "layers": layers}
        rows += [record(RESULTS, "serving_memory", metric, run[metric], "bytes", device=device, params=facts)
                 for metric in METRICS]
        rows.append(record(RESULTS, "serving_memory", "peak_rss_bytes", run["peak_rss_bytes"], "bytes", device=device,
                           baseline=plain, ratio=run["peak_rss_bytes"] / plain,
                           params={**facts, **{key: v for key, v in run.items() if key not in METRICS},
                                   "peak_rss_over_no_draft_bytes": run["peak_rss_bytes"] - plain,
                                   "loadavg": os.getloadavg()}))
    return rows


def measure(args: argparse.Namespace) -> None:
    import torch

    from bench.common import device_name
    from elsi_fast.targets import catalog

    if not args.drafts:
        raise ValueError("--drafts: give at least one draft folder")
    if args.k < 1:
        raise ValueError(f"--k: draft tokens per round must be >= 1, got {args.k}")
    torch.set_num_threads(args.threads)
    target, model, tokenizer = vllm_real.real_target(args.model)
    drafts = {path: vllm_real.load_draft(path, model, args.model) for path in args.drafts}
    by_category = vllm_real.spec_bench_prompts(tokenizer, args.prompts, args.categories, args.per_category,
                                                args.max_prompt_tokens)
    prompts = [ids for group in by_category.values() for ids in group]
    width = model.config.get_text_config().hidden_size
    common = {"model": args.model, "k": args.k, "prompts": len(prompts), "categories": list(by_category),
              "max_prompt_tokens": args.max_prompt_tokens, "max_new_tokens": args.max_new_tokens,
              "threads": args.threads, "target_hidden_size": width}
    device = device_name("cpu", args.threads)
    measured = {}
    for engine in args.engines:
        served = target  # the float32 folder; llama.cpp serves the GGUF file itself
        if engine == "vllm":
            measured[engine] = measure_vllm(args, target, prompts, drafts, width)
        elif engine == "llamacpp":
            served = catalog.resolve(args.model, "--model")
            measured[engine] = measure_llamacpp(args, served, [tokenizer.decode(ids) for ids in prompts], drafts, width)
        else:
            measured[engine] = measure_elsi_fast(args, prompts, drafts, width)
        write_rows(engine, measured[engine], drafts, {**common, "target": str(served)}, device)
    print_table(measured, drafts)


def print_table(measured: dict, drafts: dict) -> None:
    mib = lambda n: f"{n / 2**20:.1f}"  # noqa: E731
    print(f"\n{'engine':<10} {'draft':<28} {'m':>2} {'file MiB':>9} {'memory MiB':>11} {'capture B/token':>16} "
          f"{'peak RSS MiB':>13} {'over no draft':>14}")
    for engine, runs in measured.items():
        plain = runs[None]["peak_rss_bytes"]
        print(f"{engine:<10} {'(none)':<28} {'':>2} {'':>9} {'':>11} {'':>16} {mib(plain):>13}")
        for path, draft in drafts.items():
            run = runs[path]
            print(f"{engine:<10} {Path(path).name:<28} {len(draft.config.aux_layer_ids):>2} "
                  f"{mib(run['draft_file_bytes']):>9} {mib(run['draft_memory_bytes']):>11} "
                  f"{run['capture_bytes_per_token']:>16} {mib(run['peak_rss_bytes']):>13} "
                  f"{mib(run['peak_rss_bytes'] - plain):>14}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.stage == "worker":
        if not args.job:
            raise SystemExit("worker: --job is required")
        worker(args.job)
        return 0
    try:
        measure(args)
    except ValueError as exc:  # bad input: one line naming the argument
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, FileNotFoundError) as exc:  # a failed build or serving process
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
