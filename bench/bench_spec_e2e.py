"""End-to-end speed of speculative decoding with the native m=1 EAGLE3 draft, measured and modeled.

Measured (`--part measured`): the trained pair of the offline demo (`elsi-fast demo --train-drafts
--out DIR`: the 12-block d=128 stdlib target and its ELSI m=1 draft), on the demo's held-out
prompts. Tokens per second of, interleaved in one process, medians over rounds:
  * greedy:          `model.generate(do_sample=False)`, the target alone;
  * assisted:        `model.generate(assistant_model=...)`, transformers' assisted generation with
                     a 2-block model of the same tokenizer trained on the same text (cached recipe);
  * prompt_lookup:   `model.generate(prompt_lookup_num_tokens=...)`;
  * eagle3_<dtype>:  `speculative_generate` with the native draft (fp32 / bf16 / int8 weights);
  * eagle3_torch:    `speculative_generate` with the draft in torch (the path before native).
Every contender's output is checked equal to greedy decoding first.

Modeled (`--part modeled`): the demo target is compute-trivial (3.6M parameters: the Python
overhead of a forward dominates), so at a memory-bound size (a random 12-block Llama, d=1024,
vocab 32000, fp32, context 512) this times one target forward of 1 and of k+1 tokens, one native
draft step per weight dtype, and the torch extend against a loop of native steps over T target
positions; with tau measured on the trained pair the speedup a user would see is

    modeled = tau * t_target(1) / (t_target(k+1) + (k - 1 + tau) * t_draft_step)

(per round: k-1 draft-fed proposal steps and tau re-extended positions, one verification forward;
python overhead and the cache bookkeeping are left out, so it is labeled "modeled"), for every k
of `--k` with tau measured at that k and dtype, and the tau at which it would break even.
  -> bench/results/spec_e2e_cpu.jsonl

Run from the repository root: `python bench/bench_spec_e2e.py --demo-out elsi-fast-demo [--threads N]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import device_name, record  # noqa: E402
from elsi_fast.draft import Eagle3Config, Eagle3Draft, native  # noqa: E402
from elsi_fast.speculative import SpecResult, _crop, _TargetRunner, speculative_generate  # noqa: E402

FILE = "spec_e2e_cpu"
DTYPES = ("fp32", "bf16", "int8")
# The demo's evaluation prompts (cli/demo.py): 8 held-out stdlib files, first 64 tokens.
EVAL_PROMPTS, PROMPT_TOKENS = 8, 64


def interleaved(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds of every call, round-robin over the contenders (rotating the order each round) so
    that load changes on a shared machine hit every contender alike."""
    for fn in fns.values():
        fn()
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            fns[name]()
            samples[name].append(time.perf_counter() - start)
    return samples


def _conditions(threads: int) -> dict:
    return dict(threads=threads, native=native.describe("cpu"), loadavg=[round(x, 2) for x in os.getloadavg()])


# ------------------------------------------------------------------------------------ measured
def _demo_pair(demo_out: str):
    from elsi_fast.report import LayerReport
    from elsi_fast.loading import load_model
    from elsi_fast.toy_targets import DEMO, build_demo_target, build_target, heldout_texts

    report_path = os.path.join(demo_out, "report.json")
    layers = LayerReport.from_json(report_path).select("elsi", 1) if os.path.isfile(report_path) else None
    folder = os.path.join(demo_out, "drafts", "-".join(map(str, layers or [])))
    if layers is None or not os.path.isfile(os.path.join(folder, "config.json")):
        raise SystemExit(f"--demo-out {demo_out}: no trained ELSI m=1 draft there; run "
                         f"`elsi-fast demo --train-drafts --out {demo_out}` first")
    model, tokenizer = load_model(build_demo_target(progress=False), device="cpu", dtype="float32")
    draft = Eagle3Draft.from_pretrained(folder, embed_tokens=model.get_input_embeddings().weight.detach()).eval()
    # Same text, same tokenizer recipe, 2 blocks instead of 12: a small assistant of the same family.
    assistant_recipe = dataclasses.replace(DEMO, name="stdlib-demo-assistant", num_hidden_layers=2)
    assistant, assistant_tokenizer = load_model(build_target(assistant_recipe, progress=False), device="cpu", dtype="float32")
    if assistant_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise SystemExit("the assistant's tokenizer differs from the demo target's; assisted generation needs one")
    held = [t for t in heldout_texts(DEMO) if len(t) >= 100]
    step = max(1, len(held) // EVAL_PROMPTS)
    prompts = [torch.tensor([tokenizer(t[:1000])["input_ids"][:PROMPT_TOKENS]]) for t in held[::step][:EVAL_PROMPTS]]
    return model, draft, assistant, prompts, layers, folder


def bench_measured(args, dev: str) -> None:
    """Tokens/s of every contender on the trained demo pair (k = the first of --k)."""
    from transformers import GenerationConfig

    model, draft, assistant, prompts, layers, folder = _demo_pair(args.demo_out)
    n_new, k = args.new_tokens, args.k[0]
    # No EOS: every contender generates exactly n_new tokens, so tokens/s compare like for like.
    greedy_config = GenerationConfig(do_sample=False, max_new_tokens=n_new, eos_token_id=None, pad_token_id=0)
    max_len = max(p.shape[1] for p in prompts) + n_new + k + 1
    decoders = {dtype: native.NativeDraftDecoder(draft, dtype, max_len=max_len) for dtype in DTYPES}

    def hf(prompt: torch.Tensor, **kwargs) -> list[int]:
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=greedy_config,
                                 **kwargs)
        return out[0, prompt.shape[1]:].tolist()

    contenders: dict[str, Callable[[torch.Tensor], list[int] | SpecResult]] = {
        "greedy": hf,
        "assisted": lambda p: hf(p, assistant_model=assistant),
        "prompt_lookup": lambda p: hf(p, prompt_lookup_num_tokens=args.lookup_tokens),
        **{f"eagle3_{dtype}": (lambda p, d=decoders[dtype]: speculative_generate(model, d, p, n_new, k))
           for dtype in DTYPES},
        "eagle3_torch": lambda p: speculative_generate(model, draft, p, n_new, k, draft_backend="torch"),
    }
    # Same output from everyone (exact verification), and tau / call counts of the draft paths.
    taus, backends = {}, {}
    for name, run in contenders.items():
        rounds = accepted = 0
        for prompt in prompts:
            reference = hf(prompt)
            out = run(prompt)
            tokens = out.tokens.tolist() if isinstance(out, SpecResult) else out
            if tokens != reference:
                raise SystemExit(f"{name}: output differs from greedy decoding on a prompt")
            if isinstance(out, SpecResult):
                rounds, accepted = rounds + out.rounds, accepted + sum(out.accepted_lengths)
                backends[name] = out.draft_backend.split(":")[0]
        if rounds:
            taus[name] = (accepted + rounds) / rounds

    def all_prompts(run) -> Callable[[], None]:
        return lambda: [run(p) for p in prompts]

    samples = interleaved({name: all_prompts(run) for name, run in contenders.items()}, args.rounds)
    total_tokens = n_new * len(prompts)
    rate = {name: total_tokens / statistics.median(s) for name, s in samples.items()}
    params = dict(_conditions(torch.get_num_threads()), target="stdlib-demo 12x128 (3.6M)", draft=folder,
                  layers=layers, k=k, new_tokens=n_new, prompts=len(prompts), prompt_tokens=PROMPT_TOKENS,
                  rounds=args.rounds, assistant="stdlib-demo-assistant 2x128", lookup_tokens=args.lookup_tokens)
    for name, value in rate.items():
        extra = {"tau": taus.get(name), "draft_backend": backends.get(name)}
        record(FILE, "spec_e2e_measured", f"{name}_tokens_per_s", value, "tokens/s", device=dev,
               baseline=rate["greedy"], ratio=value / rate["greedy"],
               params={**params, **{k_: v for k_, v in extra.items() if v is not None}})
        tau = f", tau {taus[name]:.2f}" if name in taus else ""
        print(f"measured {name:<16} {value:8.1f} tokens/s  {value / rate['greedy']:.2f}x greedy{tau}"
              + (f"  [{backends[name]}]" if name in backends else ""))


def demo_taus(args) -> dict[tuple[str, int], float]:
    """tau of the trained demo pair per (draft dtype, k) on the benchmark prompts (not timed)."""
    from elsi_fast.evaluation import evaluate_tau

    model, draft, _, prompts, _, _ = _demo_pair(args.demo_out)
    grouped = {"stdlib": [p[0] for p in prompts]}
    return {(dtype, k): evaluate_tau(model, draft, grouped, k=k, max_new_tokens=args.new_tokens,
                                     draft_dtype=dtype)["all"]
            for dtype in DTYPES for k in args.k}


# ------------------------------------------------------------------------------------ modeled
def _random_target(d: int, intermediate: int, heads: int, kv_heads: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=intermediate, num_hidden_layers=12,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, param.shape[1] ** -0.5)
            else:
                param.fill_(1.0)
    return model


def bench_modeled(args, dev: str, taus: dict[tuple[str, int], float]) -> None:
    d, context, k_max = args.model_d, args.context, max(args.k)
    intermediate = {768: 2048, 1024: 2816}.get(d, 4 * d)
    heads = d // 64
    target = _random_target(d, intermediate, heads, heads // 2, 32000)
    target_params = sum(p.numel() for p in target.parameters())
    config = Eagle3Config(hidden_size=d, intermediate_size=intermediate, num_attention_heads=heads,
                          num_key_value_heads=heads // 2, vocab_size=32000, draft_vocab_size=32000,
                          target_hidden_size=d, aux_layer_ids=(6,))
    torch.manual_seed(1)
    draft = Eagle3Draft(config, target.get_input_embeddings().weight.detach()).eval()
    with torch.no_grad():
        for param in draft.parameters():
            if param.dim() == 2:
                param.normal_(0.0, param.shape[1] ** -0.5)

    # The target as speculative_generate drives it (KV cache, aux-state capture, argmax); the
    # context is rolled back after every timed forward.
    runner = _TargetRunner(target, list(config.aux_layer_ids))
    runner.forward(torch.randint(0, 32000, (1, context)))

    def target_forward(n: int) -> Callable[[], None]:
        ids = torch.randint(0, 32000, (1, n))

        def run() -> None:
            runner.forward(ids)
            _crop(runner.cache, context)

        return run

    feedback = torch.randn(d)
    decoders = {dtype: native.NativeDraftDecoder(draft, dtype, max_len=context + 2 * k_max + 8) for dtype in DTYPES}

    def native_step(decoder) -> Callable[[], None]:
        def run() -> None:
            decoder.length = context
            decoder.step(feedback, 7, from_target=False)

        return run

    def native_extend(decoder, n: int) -> Callable[[], None]:
        rows = torch.randn(n, d)

        def run() -> None:
            decoder.length = context
            for row in rows:
                decoder.step(row, 7, from_target=True)

        return run

    torch_cache = draft.new_cache(context + 2 * k_max + 8)
    torch_cache.length = context

    def torch_extend(n: int) -> Callable[[], None]:
        rows, ids = torch.randn(1, n, d), torch.full((1, n), 7)

        def run() -> None:
            torch_cache.length = context
            with torch.no_grad():
                draft.extend(rows, ids, torch_cache)

        return run

    fns = {"target_1": target_forward(1), **{f"target_{k + 1}": target_forward(k + 1) for k in args.k}}
    fns.update({f"draft_step_{dtype}": native_step(dec) for dtype, dec in decoders.items()})
    fns["draft_step_torch_fp32"] = torch_extend(1)
    for n in sorted({1, 2, k_max + 1}):
        fns[f"extend{n}_torch_fp32"] = torch_extend(n)
        fns[f"extend{n}_native_fp32"] = native_extend(decoders["fp32"], n)
        fns[f"extend{n}_native_int8"] = native_extend(decoders["int8"], n)
    seconds = {name: statistics.median(s) for name, s in interleaved(fns, args.rounds).items()}

    # Prompt prefill of the draft: one torch extend against a loop of native steps (few reps: slow).
    prefill = {f"prefill{args.prefill}_torch_fp32": torch_prefill(draft, args.prefill),
               **{f"prefill{args.prefill}_native_{dtype}": native_prefill(dec, args.prefill, d)
                  for dtype, dec in decoders.items()}}
    seconds.update({name: statistics.median(s) for name, s in interleaved(prefill, 3).items()})

    params = dict(_conditions(torch.get_num_threads()), target=f"random Llama 12 blocks d={d} I={intermediate} "
                  f"heads {heads}/{heads // 2} vocab 32000 fp32", target_params=target_params, context=context,
                  draft_m=1, rounds=args.rounds)
    for name, value in seconds.items():
        record(FILE, "spec_e2e_modeled_parts", f"{name}_ms", value * 1e3, "ms", device=dev, params=params)
        print(f"memory-bound d={d}: {name:<24} {value * 1e3:8.3f} ms")
    t1 = seconds["target_1"]
    for dtype in DTYPES:
        step = seconds[f"draft_step_{dtype}"]
        for k in args.k:
            tau, tk = taus[(dtype, k)], seconds[f"target_{k + 1}"]
            speedup = tau * t1 / (tk + (k - 1 + tau) * step)
            # The tau at which this k and these timings break even with greedy decoding.
            break_even = (tk + (k - 1) * step) / (t1 - step)
            record(FILE, "spec_e2e_modeled", f"eagle3_{dtype}_k{k}_modeled_speedup", speedup, "x", device=dev,
                   baseline=1.0, ratio=speedup,
                   params=dict(params, k=k, tau=tau, tau_source="measured on the trained demo pair",
                               break_even_tau=break_even, t_target_1_ms=t1 * 1e3, t_target_k1_ms=tk * 1e3,
                               t_draft_step_ms=step * 1e3, formula="tau*t1/(t(k+1)+(k-1+tau)*t_step)",
                               label="modeled"))
            print(f"modeled speedup over greedy, native {dtype}, k={k}: {speedup:.2f}x "
                  f"(tau {tau:.2f}; break-even tau {break_even:.2f})")


def torch_prefill(draft: Eagle3Draft, n: int) -> Callable[[], None]:
    rows, ids = torch.randn(1, n, draft.config.fc_in_features), torch.full((1, n), 7)
    cache = draft.new_cache(n)

    def run() -> None:
        cache.reset()
        with torch.no_grad():
            draft.extend(rows, ids, cache)

    return run


def native_prefill(decoder: native.NativeDraftDecoder, n: int, width: int) -> Callable[[], None]:
    rows = torch.randn(n, width)

    def run() -> None:
        decoder.reset()
        for row in rows:
            decoder.step(row, 7, from_target=True)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--demo-out", default="elsi-fast-demo", help="output folder of `elsi-fast demo --train-drafts`")
    parser.add_argument("--part", choices=("measured", "modeled", "all"), default="all")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--k", type=int, nargs="+", default=[4],
                        help="draft tokens per round; measured at the first, modeled at each (default 4, the demo's)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per contender (median)")
    parser.add_argument("--model-d", type=int, default=1024, help="width of the memory-bound random target")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prefill", type=int, default=64, help="prompt tokens of the draft prefill timing")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not native.available("cpu"):
        raise SystemExit(f"no native op: {native.describe('cpu')}")
    dev = device_name("cpu")
    print(f"{dev}; {native.describe('cpu')}; load average {os.getloadavg()}")
    if args.part in ("measured", "all"):
        bench_measured(args, dev)
    if args.part in ("modeled", "all"):
        bench_modeled(args, dev, demo_taus(args))
    print(f"load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
