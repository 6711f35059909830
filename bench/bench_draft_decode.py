"""Decode-step latency of the fused native draft head against PyTorch eager and the memory floor.

CPU (default): Qwen3-4B draft shapes (d=2560, 32/8 heads, head_dim 128, intermediate 9728, draft
vocab 32000, m=1) and a small d=256 draft, at a 512-token context. Paths: eager fp32
`Eagle3Draft.decode_step` (torch), native fp32 / bf16 / int8 (`NativeDraftDecoder`). The memory
floor of a path is its weight bytes / copy bandwidth, the bandwidth measured in the same run by
copying a tensor larger than the last-level cache (bytes read + written).
  -> bench/results/draft_decode_cpu.jsonl

GPU (`--device cuda`): Llama-3.1-8B draft shapes (d=4096, 32/8 heads, head_dim 128, intermediate
14336, draft vocab 32000, m=1), bf16: eager module, eager module captured in a CUDA graph, native
op (launched, and captured in a CUDA graph), HBM floor from a device copy.
  -> bench/results/draft_decode_gpu.jsonl

Also writes the memory rows of issue 5: weight bytes of m=1 vs m=3 drafts and the target-side
capture buffer per token, for Llama-3.1-8B and Qwen3-4B shapes.

Run from the repository root: `python bench/bench_draft_decode.py [--device cuda] [--quick] [--threads N]`.
On a CPU shared with other jobs every OpenMP barrier can wait a scheduler time slice for a
preempted thread, so compare `--threads 1` with the default there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from functools import partial
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import device_name, record, time_fn  # noqa: E402
from elsi_fast.draft import Eagle3Config, Eagle3Draft, native  # noqa: E402

CONTEXT = 512
SHAPES = {
    # target vocab set to the draft vocab: the embedding table is read one row a step, and the real
    # 152k x 2560 fp32 table would only cost memory here.
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=32000, draft_vocab_size=32000, target_hidden_size=2560),
    "small-d256": dict(hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, vocab_size=32000, draft_vocab_size=32000, target_hidden_size=256),
    "llama3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                        head_dim=128, vocab_size=128256, draft_vocab_size=32000, target_hidden_size=4096),
}
# Real vocabularies for the memory rows.
TARGET_VOCAB = {"qwen3-4b": 151936, "llama3.1-8b": 128256}


def make_draft(name: str, device: str, dtype: torch.dtype, num_aux: int = 1) -> Eagle3Draft:
    config = Eagle3Config(**SHAPES[name], aux_layer_ids=tuple(range(1, num_aux + 1)), rope_theta=500000.0)
    with torch.device(device):
        embed = torch.randn(config.vocab_size, config.hidden_size, dtype=dtype) * 0.02
        draft = Eagle3Draft(config, embed).to(dtype)
    with torch.no_grad():
        for param in draft.parameters():
            if param.dim() == 2:
                param.normal_(0.0, param.shape[1] ** -0.5)
    return draft


def copy_timer(device: str, nbytes: int) -> tuple[Callable[[], object], int]:
    """A large tensor copy and the bytes it moves (read + written)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * nbytes


def interleaved_medians(fns: dict[str, Callable[[], object]], reps: int, device: str) -> dict[str, float]:
    """Median seconds of each fn, timed round-robin so that load changes on a shared machine hit
    every path alike (the ratios are what matter)."""
    for fn in fns.values():
        time_fn(fn, warmup=2, reps=1, device=device)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            samples[name].append(time_fn(fn, warmup=0, reps=1, device=device))
    return {name: statistics.median(times) for name, times in samples.items()}


def memory_rows(file: str, dev: str) -> None:
    for name in ("llama3.1-8b", "qwen3-4b"):
        for num_aux in (1, 3):
            config = Eagle3Config(**{**SHAPES[name], "vocab_size": TARGET_VOCAB[name]},
                                  aux_layer_ids=tuple(range(1, num_aux + 1)))
            with torch.device("meta"):
                draft = Eagle3Draft(config)
            params = sum(p.numel() for p in draft.parameters())
            common = dict(shape=name, m=num_aux)
            record(file, "draft_memory", "trainable_params", params, "params", device=dev, params=common)
            record(file, "draft_memory", "weight_bytes_bf16", 2 * params, "bytes", device=dev, params=common)
            record(file, "draft_memory", "capture_bytes_per_token_bf16", 2 * num_aux * config.target_hidden_size,
                   "bytes", device=dev, params=common)


def prefilled_cache(draft: Eagle3Draft):
    cache = draft.new_cache(CONTEXT + 1)
    cache.key.normal_()
    cache.value.normal_()
    cache.length = CONTEXT
    return cache


def bench_cpu(shape_names: list[str], reps: int) -> None:
    file, dev = "draft_decode_cpu", device_name("cpu")
    copy, copy_bytes = copy_timer("cpu", 1 << 30)  # 1 GiB each way, beyond the 480 MB L3 seen here
    print(native.describe("cpu"))
    for name in shape_names:
        draft = make_draft(name, "cpu", torch.float32)
        aux = torch.randn(1, 1, draft.config.fc_in_features)
        token = torch.tensor([[7]])
        cache = prefilled_cache(draft)

        def eager() -> None:
            draft.decode_step(aux, token, cache, from_target=True, use_native=False)
            cache.length = CONTEXT

        fns: dict[str, Callable[[], object]] = {"copy": copy, "eager_fp32": eager}
        decoders = {}
        for weight_dtype in ("fp32", "bf16", "int8"):
            decoder = native.NativeDraftDecoder(draft, weight_dtype, max_len=CONTEXT + 1)
            decoder._k_cache.normal_()
            decoder._v_cache.normal_()
            decoders[weight_dtype] = decoder
            fns[weight_dtype] = partial(fused_step, decoder, aux.flatten())
        seconds = interleaved_medians(fns, reps, "cpu")
        bandwidth = copy_bytes / seconds["copy"]
        eager_s = seconds["eager_fp32"]
        params = dict(shape=name, context=CONTEXT, m=1, threads=torch.get_num_threads(), from_target=True,
                      native=native.describe("cpu"), reps=reps, note="shared CPU: timings may be noisy")
        record(file, "draft_decode", "copy_bandwidth", bandwidth / 1e9, "GB/s", device=dev,
               params=dict(params, bytes=copy_bytes, note="read + written; " + params["note"]))
        record(file, "draft_decode", "eager_fp32_ms", eager_s * 1e3, "ms", device=dev, params=params)
        print(f"{name}: copy bandwidth {bandwidth / 1e9:.1f} GB/s, eager fp32 {eager_s * 1e3:.2f} ms")
        for weight_dtype, decoder in decoders.items():
            t = seconds[weight_dtype]
            floor = decoder.weight_bytes / bandwidth
            row = dict(params, weight_dtype=weight_dtype, weight_bytes=decoder.weight_bytes)
            record(file, "draft_decode", f"native_{weight_dtype}_ms", t * 1e3, "ms", device=dev,
                   baseline=eager_s * 1e3, ratio=eager_s / t, params=row)
            record(file, "draft_decode", f"native_{weight_dtype}_vs_memory_floor", t / floor, "x",
                   device=dev, baseline=floor * 1e3, ratio=t / floor, params=row)
            print(f"{name}: native {weight_dtype} {t * 1e3:.2f} ms, {eager_s / t:.2f}x faster than eager, "
                  f"{t / floor:.2f}x its memory floor ({floor * 1e3:.2f} ms)")
        del draft, cache, decoders, fns


def fused_step(decoder: native.NativeDraftDecoder, aux: torch.Tensor) -> None:
    """One target-fed step at position CONTEXT of a cache holding CONTEXT positions."""
    decoder.length = CONTEXT
    decoder.step(aux, 7, from_target=True)


def bench_gpu(reps: int) -> None:
    file, dev, device = "draft_decode_gpu", device_name("cuda"), "cuda"
    if not native.available(device):
        raise SystemExit(f"no native CUDA op: {native.describe(device)}")
    copy, copy_bytes = copy_timer(device, 4 << 30)
    bandwidth = copy_bytes / time_fn(copy, warmup=2, reps=10, device=device)
    record(file, "draft_decode", "copy_bandwidth", bandwidth / 1e9, "GB/s", device=dev,
           params=dict(bytes=copy_bytes, note="read + written"))
    name = "llama3.1-8b"
    draft = make_draft(name, device, torch.bfloat16)
    config = draft.config
    aux = torch.randn(1, 1, config.fc_in_features, device=device, dtype=torch.bfloat16)
    token = torch.tensor([[7]], device=device)
    cache = prefilled_cache(draft)
    params = dict(shape=name, context=CONTEXT, m=1, from_target=True, native=native.describe(device))

    def eager() -> None:
        draft.decode_step(aux, token, cache, from_target=True, use_native=False)
        cache.length = CONTEXT

    eager_s = time_fn(eager, warmup=3, reps=reps, device=device)
    record(file, "draft_decode", "eager_bf16_ms", eager_s * 1e3, "ms", device=dev, params=params)

    graph_s = None
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            eager()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eager()
        graph_s = time_fn(graph.replay, warmup=3, reps=reps, device=device)
        record(file, "draft_decode", "eager_bf16_cuda_graph_ms", graph_s * 1e3, "ms", device=dev, params=params)
    except RuntimeError as exc:  # report, keep measuring the native path
        print(f"eager module could not be captured in a CUDA graph: {exc}")

    decoder = native.NativeDraftDecoder(draft, "bf16", max_len=CONTEXT + 1)
    decoder._k_cache.normal_()
    decoder._v_cache.normal_()
    flat_aux = aux.flatten()
    fused = partial(fused_step, decoder, flat_aux)

    fused_s = time_fn(fused, warmup=3, reps=reps, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused()
    torch.cuda.current_stream().wait_stream(stream)
    native_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(native_graph):
        fused()
    fused_graph_s = time_fn(native_graph.replay, warmup=3, reps=reps, device=device)
    floor = decoder.weight_bytes / bandwidth
    row = dict(params, weight_bytes=decoder.weight_bytes)
    for metric, seconds in (("native_bf16_ms", fused_s), ("native_bf16_cuda_graph_ms", fused_graph_s)):
        record(file, "draft_decode", metric, seconds * 1e3, "ms", device=dev, baseline=eager_s * 1e3,
               ratio=eager_s / seconds, params=row)
        if graph_s is not None:
            record(file, "draft_decode", f"{metric[:-3]}_vs_eager_graph", graph_s / seconds, "x", device=dev,
                   baseline=graph_s * 1e3, ratio=graph_s / seconds, params=row)
        record(file, "draft_decode", f"{metric[:-3]}_vs_hbm_floor", seconds / floor, "x", device=dev,
               baseline=floor * 1e3, ratio=seconds / floor, params=row)
    print(f"eager {eager_s * 1e3:.3f} ms, eager graph {graph_s and graph_s * 1e3} ms, native {fused_s * 1e3:.3f} ms, "
          f"native graph {fused_graph_s * 1e3:.3f} ms, HBM floor {floor * 1e3:.3f} ms")

    # Agreement on the device: one step from the same cache state, native vs the module's torch path.
    decoder.length = CONTEXT
    cache.key[0, :, :CONTEXT] = decoder._k_cache[:, :CONTEXT].bfloat16()
    cache.value[0, :, :CONTEXT] = decoder._v_cache[:, :CONTEXT].bfloat16()
    cache.length = CONTEXT
    ids, hidden = decoder.step(flat_aux, 7, from_target=True, top_k=4)
    ref_ids, ref_hidden = draft.decode_step(aux, token, cache, from_target=True, top_k=4, use_native=False)
    err = float((hidden.float() - ref_hidden.flatten().float()).abs().max() / ref_hidden.float().abs().max())
    record(file, "draft_decode", "native_vs_eager_hidden_rel_err", err, "ratio", device=dev, params=row)
    record(file, "draft_decode", "native_vs_eager_top1_equal", float(ids[0] == ref_ids[0, 0]), "bool",
           device=dev, params=row)
    print(f"native vs eager: hidden rel err {err:.2e}, ids {ids.tolist()} vs {ref_ids[0].tolist()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="only the small d=256 draft (CPU), fewer reps")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for eager and native alike (default: torch's setting)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with torch.no_grad():
        if args.device == "cuda":
            memory_rows("draft_decode_gpu", device_name("cuda"))
            bench_gpu(reps=20)
        else:
            memory_rows("draft_decode_cpu", device_name("cpu"))
            bench_cpu(["small-d256"] if args.quick else ["small-d256", "qwen3-4b"], reps=5 if args.quick else 10)


if __name__ == "__main__":
    main()
