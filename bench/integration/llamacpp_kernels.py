"""The native m=1 EAGLE3 draft step against llama.cpp's ggml CPU kernels on the same shapes, at batch 1.

    python -m bench.integration.llamacpp_kernels            # SmolLM2 and Llama-3.1-8B draft shapes, 1 and 2 threads
    python -m bench.integration.llamacpp_kernels --smoke    # SmolLM2 shapes, 3 rounds: checks the script

ggml: a one-block Llama GGUF with random weights whose vocabulary is the draft vocabulary (8192 for
SmolLM2, 32000 for Llama-3.1-8B), so "one block plus the head": `tokenizer.ggml.model = "none"` with
`llama.vocab_size` gives llama.cpp that many dummy tokens, llama-bench feeds random ids, and the head
is tied to the token embedding (one file, same bytes read). Timed by llama.cpp's own llama-bench,
generation test: `-p 0 -n 64 -d 480 -fa on -ctk f16 -ctv f16 -r 1` (64 tokens after 480 of context attend
512.5 positions on average, as our step at context 512 attends 513; flash attention, which `auto`
picks on the CPU too, skips the masked positions of the padded cache). llama-bench takes no f32 KV
cache (f16, its default, is the widest), so ggml reads half the KV bytes of our fp32 cache: 0.4 MB
less a token of 9.6 MB at SmolLM2 Q8_0, 2.1 MB less of 373 MB at Llama-8B Q8_0.
The files (F32, BF16, F16, Q8_0) are written once into ~/.cache/elsi-fast/llamacpp-kernels/.
elsi-fast: `NativeDraftDecoder` target-fed steps at context 512 on bench_draft_decode.py's drafts,
with a fixed team of 1 or 2 threads, in runs of 64 consecutive steps: each side yields the mean time
per token of 64 tokens, and a round runs every contender once (the order reversed every other round,
so load changes on a shared machine hit both alike); medians of --reps rounds.
Pairs at equal precision: fp32 vs F32, bf16 vs BF16 and F16, int8 vs Q8_0 (Q8_0: a fp16 scale per 32
weights, activations quantized to int8; ours: a scale per row, int16 activations).

The two sides do not read the same bytes. The EAGLE3 block's q/k/v take 2d inputs and a target-fed
step also reads fc (m * d_target -> d): 11-12% more weight bytes than the Llama block and head of
the same d and vocabulary at equal width, 4-5% in int8 against Q8_0 (whose fp16 scale per 32
weights adds 6%); and our fp32 KV cache is twice ggml's f16 one. So each row has the bytes that side
reads per token (ours: `step_read_bytes`; ggml: the GGUF's tensor bytes, one embedding row and the
f16 KV cache at 512.5 positions) and bytes / time (effective GB/s). The headline, ms per step
against ms per token, is biased toward ggml: at equal ms ours moves 5-12% more bytes per second.
Floor: those bytes over the read bandwidth of `torch.sum` on a 512 MiB fp32 buffer at the same thread
count, timed in the same rounds. Issue targets: ours >= 1.2x ggml's speed, within 1.3x of its floor.
  -> bench/results/llamacpp_kernels_cpu.jsonl

Needs the llama.cpp build of llamacpp.py (`python -m bench.integration.llamacpp build`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch

from bench.bench_draft_decode import (CONTEXT, CPU_EMBED_ROWS, READ_BUFFER_BYTES, SHAPES, make_draft,
                                      native_step)
from bench.common import device_name, record
from bench.integration.llamacpp import CACHE, binary, build_dir
from elsi_fast.draft import Eagle3Draft
from elsi_fast.draft.native import NativeDraftDecoder

RESULTS_FILE = "llamacpp_kernels_cpu"
GGUF_DIR = CACHE.parent / "llamacpp-kernels"
N_GEN = 64
DEPTH = CONTEXT - N_GEN // 2  # the 64 generated tokens attend 512.5 positions on average
KV_TYPE, KV_ELEMENT_BYTES = "f16", 2  # llama-bench's widest KV cache type
PAIRS = {"fp32": ("F32",), "bf16": ("BF16", "F16"), "int8": ("Q8_0",)}
FILE_TYPES = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
              "BF16": gguf.LlamaFileType.MOSTLY_BF16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
TARGET_SPEEDUP, TARGET_VS_FLOOR = 1.2, 1.3
DEFAULT_SHAPES = ("smollm2", "llama3.1-8b")
Timer = Callable[[], float]  # one sample: seconds per token


# ------------------------------------------------------------------------------------- ggml side
def gguf_path(shape: str, ggml_type: str) -> Path:
    s = SHAPES[shape]
    return GGUF_DIR / (f"llama-1block-d{s['hidden_size']}-ff{s['intermediate_size']}-h{s['num_attention_heads']}"
                       f"kv{s['num_key_value_heads']}-v{s['draft_vocab_size']}-{ggml_type}.gguf")


def one_block_gguf(shape: str, ggml_type: str) -> Path:
    """The one-block Llama of `shape` with weights in `ggml_type` (norms F32), written once."""
    path = gguf_path(shape, ggml_type)
    if path.is_file():
        return path
    s = SHAPES[shape]
    d, ff, hd, vocab = s["hidden_size"], s["intermediate_size"], s["head_dim"], s["draft_vocab_size"]
    q_dim, kv_dim = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd
    matrices = {"token_embd.weight": (vocab, d), "blk.0.attn_q.weight": (q_dim, d), "blk.0.attn_k.weight": (kv_dim, d),
                "blk.0.attn_v.weight": (kv_dim, d), "blk.0.attn_output.weight": (d, q_dim),
                "blk.0.ffn_gate.weight": (ff, d), "blk.0.ffn_up.weight": (ff, d), "blk.0.ffn_down.weight": (d, ff)}
    norms = ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight")
    qtype, f32 = gguf.GGMLQuantizationType[ggml_type], gguf.GGMLQuantizationType.F32
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(partial, "llama")
    writer.add_name(f"one {shape}-shaped Llama block + head, random weights")
    writer.add_file_type(FILE_TYPES[ggml_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(4096)
    writer.add_embedding_length(d)
    writer.add_block_count(1)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(s["num_attention_heads"])
    writer.add_head_count_kv(s["num_key_value_heads"])
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_rope_dimension_count(hd)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("none")
    for name in norms:
        writer.add_tensor_info(name, (d,), np.dtype(np.float32), 4 * d, raw_dtype=f32)
    for name, shape_2d in matrices.items():
        nbytes = math.prod(gguf.quant_shape_to_byte_shape(shape_2d, qtype))
        writer.add_tensor_info(name, shape_2d, np.dtype(np.float32), nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _ in norms:
        writer.write_tensor_data(np.ones(d, dtype=np.float32))
    rng = np.random.default_rng(0)
    for shape_2d in matrices.values():  # one matrix in memory at a time
        weight = rng.standard_normal(shape_2d, dtype=np.float32) * np.float32(shape_2d[1] ** -0.5)
        writer.write_tensor_data(gguf.quants.quantize(weight, qtype))
    writer.close()
    partial.rename(path)
    return path


def ggml_read_bytes(path: Path, shape: str) -> int:
    """Bytes a generated token reads: every tensor (the tied head reads all of token_embd), one
    embedding row for the input, and the f16 KV cache over the mean 512.5 attended positions."""
    s = SHAPES[shape]
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    kv = 2 * s["num_key_value_heads"] * s["head_dim"] * KV_ELEMENT_BYTES * (DEPTH + (N_GEN + 1) / 2)
    return sum(tensors.values()) + tensors["token_embd.weight"] // s["draft_vocab_size"] + round(kv)


class LlamaBench:
    """llama-bench's generation test on one GGUF at a fixed thread count; keeps its last JSON row."""

    def __init__(self, path: Path, threads: int) -> None:
        self.cmd = [str(binary("llama-bench")), "-m", str(path), "-p", "0", "-n", str(N_GEN), "-d", str(DEPTH),
                    "-t", str(threads), "-r", "1", "-fa", "on", "-ctk", KV_TYPE, "-ctv", KV_TYPE, "-o", "json"]
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.last: dict = {}

    def __call__(self) -> float:
        done = subprocess.run(self.cmd, capture_output=True, text=True, env=self.env)
        if done.returncode != 0:
            raise RuntimeError(f"llama-bench failed (exit {done.returncode}) on {self.cmd[2]}: "
                               f"{(done.stderr.strip().splitlines() or ['no output'])[-1]}")
        self.last = json.loads(done.stdout)[0]
        return self.last["samples_ns"][0] / N_GEN / 1e9


# ------------------------------------------------------------------------------------- elsi-fast side
def native_timer(decoder: NativeDraftDecoder) -> Timer:
    """Mean seconds of N_GEN consecutive target-fed steps at context CONTEXT."""
    step = native_step(decoder)

    def run() -> float:
        start = time.perf_counter()
        for _ in range(N_GEN):
            step()
        return (time.perf_counter() - start) / N_GEN

    return run


def read_timer(buffer: torch.Tensor, threads: int) -> Timer:
    """Seconds of one `torch.sum` over `buffer` (beyond any L3) at `threads` threads."""
    def run() -> float:
        torch.set_num_threads(threads)
        start = time.perf_counter()
        buffer.sum()
        return time.perf_counter() - start

    return run


def interleaved(timers: dict[tuple[str, int], Timer], reps: int) -> dict[tuple[str, int], float]:
    """Median sample of every timer over `reps` rounds after one warm-up round (page cache, thread
    pools); every round runs all of them, in reverse order every other round."""
    keys = list(timers)
    for key in keys:
        timers[key]()
    samples: dict[tuple[str, int], list[float]] = {key: [] for key in keys}
    for r in range(reps):
        for key in keys if r % 2 == 0 else reversed(keys):
            samples[key].append(timers[key]())
    return {key: statistics.median(values) for key, values in samples.items()}


# ------------------------------------------------------------------------------------- one precision
def bench_precision(shape: str, draft: Eagle3Draft, precision: str, threads: list[int], reps: int,
                    buffer: torch.Tensor) -> None:
    """Our step at `precision` and ggml at each equal type, interleaved at each thread count; the rows."""
    decoders = {t: NativeDraftDecoder(draft, precision, max_len=CONTEXT + 1, threads=t) for t in threads}
    files = {g: one_block_gguf(shape, g) for g in PAIRS[precision]}
    benches = {(g, t): LlamaBench(path, t) for g, path in files.items() for t in threads}
    timers: dict[tuple[str, int], Timer] = {}
    for t in threads:
        timers[("read", t)] = read_timer(buffer, t)
        timers[(f"elsi_{precision}", t)] = native_timer(decoders[t])
        timers.update({(f"ggml_{g}", t): benches[(g, t)] for g in files})
    load_before = os.getloadavg()
    seconds = interleaved(timers, reps)
    ggml_bytes = {g: ggml_read_bytes(path, shape) for g, path in files.items()}
    ours_bytes = decoders[threads[0]].step_read_bytes(True, CONTEXT)
    common = dict(shape=shape, precision=precision, context=CONTEXT, m=1, from_target=True, reps=reps,
                  n_gen=N_GEN, depth=DEPTH, loadavg_before=load_before, loadavg_after=os.getloadavg(),
                  llamacpp_build=build_dir().name)
    for t in threads:
        dev = device_name("cpu", threads=t)
        bandwidth = READ_BUFFER_BYTES / seconds[("read", t)]
        row = dict(common, threads=t)
        record(RESULTS_FILE, "llamacpp_kernels", "read_bandwidth", bandwidth / 1e9, "GB/s", device=dev,
               params=dict(row, bytes=READ_BUFFER_BYTES, how="torch.sum over a 512 MiB fp32 buffer"))
        ours_s = seconds[(f"elsi_{precision}", t)]
        ours = dict(row, bytes=ours_bytes, effective_gbps=ours_bytes / ours_s / 1e9,
                    floor_ms=ours_bytes / bandwidth * 1e3, vs_floor=ours_s * bandwidth / ours_bytes,
                    target_vs_floor=TARGET_VS_FLOOR, native=decoders[t].describe())
        record(RESULTS_FILE, "llamacpp_kernels", f"elsi_{precision}_ms", ours_s * 1e3, "ms", device=dev,
               baseline=ours["floor_ms"], ratio=ours["vs_floor"], params=ours)
        print(f"{shape} {t}t read {bandwidth / 1e9:.1f} GB/s | elsi {precision:<5} {ours_s * 1e3:8.3f} ms "
              f"{ours_bytes / 1e6:8.1f} MB {ours['effective_gbps']:5.1f} GB/s ({ours['vs_floor']:.2f}x floor)")
        for g in files:
            ggml_s, last = seconds[(f"ggml_{g}", t)], benches[(g, t)].last
            theirs = dict(row, ggml_type=g, bytes=ggml_bytes[g], effective_gbps=ggml_bytes[g] / ggml_s / 1e9,
                          floor_ms=ggml_bytes[g] / bandwidth * 1e3, vs_floor=ggml_s * bandwidth / ggml_bytes[g],
                          cmd=benches[(g, t)].cmd, model_size=last["model_size"], flash_attn=last["flash_attn"],
                          type_k=last["type_k"], type_v=last["type_v"], repack=last["repack"])
            record(RESULTS_FILE, "llamacpp_kernels", f"ggml_{g}_ms", ggml_s * 1e3, "ms", device=dev,
                   baseline=theirs["floor_ms"], ratio=theirs["vs_floor"], params=theirs)
            speedup = ggml_s / ours_s
            record(RESULTS_FILE, "llamacpp_kernels", f"elsi_{precision}_vs_ggml_{g}", speedup, "x", device=dev,
                   baseline=ggml_s * 1e3, ratio=speedup,
                   params=dict(row, ggml_type=g, ms=ours_s * 1e3, bytes=ours_bytes, ggml_bytes=ggml_bytes[g],
                               bytes_ratio=ours_bytes / ggml_bytes[g],
                               per_byte_speedup=ours["effective_gbps"] / theirs["effective_gbps"],
                               target=TARGET_SPEEDUP, met=speedup >= TARGET_SPEEDUP))
            print(f"{'':>{len(shape) + 3}}   vs ggml {g:<5} {ggml_s * 1e3:8.3f} ms {ggml_bytes[g] / 1e6:8.1f} MB "
                  f"{theirs['effective_gbps']:5.1f} GB/s ({theirs['vs_floor']:.2f}x floor): elsi {speedup:.2f}x ggml's "
                  f"speed per step, {ours['effective_gbps'] / theirs['effective_gbps']:.2f}x per byte "
                  f"(target {TARGET_SPEEDUP}x: {'met' if speedup >= TARGET_SPEEDUP else 'MISSED'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="SmolLM2 shapes only, 3 rounds")
    parser.add_argument("--reps", type=int, default=None, help="rounds (default 10; 3 with --smoke)")
    parser.add_argument("--shapes", nargs="+", choices=DEFAULT_SHAPES, default=None)
    parser.add_argument("--precisions", nargs="+", choices=sorted(PAIRS), default=list(PAIRS))
    parser.add_argument("--threads", nargs="+", type=int, choices=(1, 2), default=[1, 2])
    args = parser.parse_args()
    shapes = args.shapes or (["smollm2"] if args.smoke else list(DEFAULT_SHAPES))
    reps = args.reps or (3 if args.smoke else 10)
    binary("llama-bench")  # fail before building anything when llama.cpp is not built
    torch.manual_seed(0)
    torch.set_num_threads(max(args.threads))
    buffer = torch.ones(READ_BUFFER_BYTES // 4)
    with torch.no_grad():
        for shape in shapes:
            draft = make_draft(shape, "cpu", torch.float32, vocab_size=CPU_EMBED_ROWS)
            for precision in args.precisions:
                bench_precision(shape, draft, precision, args.threads, reps, buffer)
            del draft


if __name__ == "__main__":
    main()
