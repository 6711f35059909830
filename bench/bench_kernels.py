"""GPU benchmarks of the Triton kernels (issue 3) against torch, with ceilings measured in the same run.

    python -m bench.bench_kernels            # on a CUDA machine: rows to bench/results/kernels_gpu.jsonl
    python -m bench.bench_kernels --quick    # tiny sizes, any machine (CPU: Triton interpreter), to
                                             # check the script itself; rows go to kernels_quick.jsonl

Ceilings: a large device-to-device copy (GB/s counting bytes read and written) and a large bf16
torch.matmul (TFLOP/s). Each kernel is timed for a few tile shapes (the default first), and every
ratio is measured side by side in this run. The torch baselines reuse the references of
tests/kernels/.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict

import torch

if not torch.cuda.is_available():
    # CPU tensors reach the kernels only through the interpreter, which must be on before import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from triton.runtime.errors import OutOfResources  # noqa: E402

from bench.common import device_name, record, tests_module, time_fn  # noqa: E402
from elsi_fast.kernels.covariance import CovarianceTiles, covariance_accumulate_  # noqa: E402
from elsi_fast.kernels.covariance import default_tiles as covariance_default_tiles  # noqa: E402
from elsi_fast.kernels.entropy import (  # noqa: E402
    EntropyTiles,
    LinearEntropyTiles,
    default_entropy_tiles,
    default_linear_tiles,
    linear_token_entropy,
    token_entropy,
)
from elsi_fast.kernels.hsic import HsicTiles, minibatch_hsic  # noqa: E402
from elsi_fast.kernels.hsic import default_tiles as hsic_default_tiles  # noqa: E402


entropy_reference = tests_module("kernels/test_entropy.py").entropy_reference
u_center = tests_module("kernels/test_hsic.py").u_center

FULL = dict(cov=(36, 4096, 2560), hsic=(37, 1024, 2560), entropy=(8192, 151936), linear=(8192, 2560, 151936),
            copy_bytes=2 << 30, matmul=8192)
QUICK = dict(cov=(3, 64, 48), hsic=(3, 32, 40), entropy=(16, 1000), linear=(16, 32, 500),
             copy_bytes=1 << 20, matmul=128)


class Bench:
    def __init__(self, device: torch.device, quick: bool):
        self.device, self.quick = device, quick
        self.file = "kernels_quick" if quick else "kernels_gpu"
        self.name = device_name(device)
        self.reps = 2 if quick else 10

    def time(self, fn, reps: int | None = None) -> float:
        return time_fn(fn, warmup=1 if self.quick else 3, reps=reps or self.reps, device=self.device)

    def time_tiles(self, fn, tiles, reps: int | None = None) -> float | None:
        """Time one launch shape; None (and a note) when it does not fit the device."""
        try:
            return self.time(fn, reps)
        except OutOfResources as err:
            print(f"tiles {tiles} skipped: {err}", flush=True)
            return None

    def record(self, benchmark, metric, value, unit, **kw):
        row = record(self.file, benchmark, metric, value, unit, device=self.name, **kw)
        ratio = f" ratio={row['ratio']:.3g}" if row["ratio"] is not None else ""
        print(f"{benchmark:28s} {metric:36s} {value:12.4g} {unit}{ratio}", flush=True)

    def peak_extra_bytes(self, fn) -> int | None:
        if self.device.type != "cuda":
            return None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before


def ceilings(b: Bench, sizes: dict) -> tuple[float, float]:
    """(copy GB/s counting read + write, bf16 matmul TFLOP/s)."""
    src = torch.empty(sizes["copy_bytes"], dtype=torch.uint8, device=b.device)
    dst = torch.empty_like(src)
    t = b.time(lambda: dst.copy_(src))
    copy_gbs = 2 * src.numel() / t / 1e9
    b.record("ceiling", "copy_bandwidth", copy_gbs, "GB/s", params={"bytes": src.numel()})
    del src, dst
    m = sizes["matmul"]
    x = torch.randn(m, m, device=b.device, dtype=torch.bfloat16)
    y = torch.randn(m, m, device=b.device, dtype=torch.bfloat16)
    t = b.time(lambda: torch.matmul(x, y))
    tflops = 2 * m**3 / t / 1e12
    b.record("ceiling", "bf16_matmul", tflops, "TFLOP/s", params={"m": m, "n": m, "k": m})
    return copy_gbs, tflops


def bench_covariance(b: Bench, sizes: dict, matmul_tflops: float) -> None:
    num_layers, n, dim = sizes["cov"]
    params = {"L": num_layers, "n": n, "d": dim, "dtype": "bf16", "l2_normalize": True}
    x = torch.randn(num_layers, n, dim, device=b.device, dtype=torch.bfloat16)
    shift = torch.zeros(num_layers, dim, device=b.device)
    sum_xx = torch.zeros(num_layers, dim, dim, device=b.device)
    sum_x = torch.zeros(num_layers, dim, device=b.device)

    def torch_layerwise():
        for a in range(num_layers):
            xf = x[a].float()
            sum_xx[a].addmm_(xf.T, xf)

    def torch_layerwise_bf16():
        # Tensor-core reference point only: bf16 output, no normalization, shift or accumulation.
        for a in range(num_layers):
            x[a].T @ x[a]

    baseline = b.time(torch_layerwise)
    b.record("covariance", "torch_layerwise_xTx", baseline * 1e3, "ms", params=params)
    bf16_time = b.time(torch_layerwise_bf16)
    b.record("covariance", "torch_layerwise_bf16_xTx", bf16_time * 1e3, "ms", params=params)
    useful_flops = num_layers * n * dim * (dim + 1)  # 2 n per entry of the upper triangle
    configs = [covariance_default_tiles(torch.bfloat16)]
    if not b.quick:
        configs += [CovarianceTiles(128, 64, 8, 3, pack=False), CovarianceTiles(128, 32, 8, 4),
                    CovarianceTiles(128, 128, 8, 3)]
    for i, tiles in enumerate(configs):
        t = b.time_tiles(lambda: covariance_accumulate_(x, None, shift, True, sum_xx, sum_x, tiles=tiles), tiles)
        if t is None:
            continue
        p = {**params, "tiles": asdict(tiles), "default": i == 0}
        b.record("covariance", "kernel_time", t * 1e3, "ms", baseline=baseline * 1e3, ratio=baseline / t, params=p)
        b.record("covariance", "kernel_vs_bf16_xTx", t * 1e3, "ms", baseline=bf16_time * 1e3, ratio=bf16_time / t,
                 params=p)
        tflops = useful_flops / t / 1e12
        b.record("covariance", "triangle_tflops_vs_matmul", tflops, "TFLOP/s", baseline=matmul_tflops,
                 ratio=tflops / matmul_tflops, params=p)
    mask = torch.rand(n, device=b.device) < 0.8
    t = b.time(lambda: covariance_accumulate_(x, mask, shift, True, sum_xx, sum_x))
    b.record("covariance", "kernel_time_80pct_tokens_kept", t * 1e3, "ms", params={**params, "kept": int(mask.sum())})
    extra = b.peak_extra_bytes(lambda: covariance_accumulate_(x, mask, shift, True, sum_xx, sum_x))
    if extra is not None:
        b.record("covariance", "kernel_peak_extra_memory", extra / 2**20, "MiB", baseline=x.numel() * 2 / 2**20,
                 ratio=extra * 1.0 / (x.numel() * 2), params={**params, "baseline": "the bf16 input batch"})


def bench_hsic(b: Bench, sizes: dict) -> None:
    from elsi_fast import MinibatchHSIC

    num_layers, n, dim = sizes["hsic"]
    params = {"L": num_layers, "n": n, "d": dim, "dtype": "bf16", "l2_normalize": True}
    x = torch.randn(num_layers, n, dim, device=b.device, dtype=torch.bfloat16)
    x += torch.randn(1, n, dim, device=b.device, dtype=torch.bfloat16)  # shared component

    def pair_loop():
        y = x.float()
        y = y / y.norm(dim=-1, keepdim=True)
        grams = y @ y.transpose(1, 2)
        out = torch.empty(num_layers, num_layers, device=b.device)
        for a in range(num_layers):
            for c in range(a, num_layers):
                out[a, c] = (u_center(grams[a]) * u_center(grams[c])).sum() / (n * (n - 3))
        return out

    def unfused_torch():
        os.environ["ELSI_FAST_DISABLE_TRITON"] = "1"
        try:
            MinibatchHSIC(num_layers, device=b.device).update(x)
        finally:
            del os.environ["ELSI_FAST_DISABLE_TRITON"]

    def unfused_bf16_grams():
        # A fast torch rendering of the same computation: bf16 tensor-core Grams, U-centering, one GEMM.
        y = x.float()
        y = y / y.norm(dim=-1, keepdim=True)
        y = (y - y.mean(1, keepdim=True)).to(torch.bfloat16)
        grams = torch.bmm(y, y.transpose(1, 2)).float()
        flat = torch.stack([u_center(g) for g in grams]).reshape(num_layers, -1)
        return flat @ flat.T / (n * (n - 3))

    loop_time = b.time(pair_loop, reps=1 if not b.quick else 2)
    b.record("hsic", "torch_pair_loop", loop_time * 1e3, "ms", params=params)
    unfused = b.time(unfused_torch)
    b.record("hsic", "torch_unfused_gram_gemm", unfused * 1e3, "ms", params=params)
    unfused_bf16 = b.time(unfused_bf16_grams)
    b.record("hsic", "torch_unfused_bf16_grams", unfused_bf16 * 1e3, "ms", params=params)
    configs = [hsic_default_tiles(torch.bfloat16)]
    if not b.quick:
        configs += [HsicTiles(128, 32, 8, 4), HsicTiles(64, 64, 4, 3)]
    for i, tiles in enumerate(configs):
        t = b.time_tiles(lambda: minibatch_hsic(x, None, True, tiles=tiles), tiles)
        if t is None:
            continue
        p = {**params, "tiles": asdict(tiles), "default": i == 0}
        b.record("hsic", "kernel_vs_pair_loop", t * 1e3, "ms", baseline=loop_time * 1e3, ratio=loop_time / t, params=p)
        b.record("hsic", "kernel_vs_unfused_torch", t * 1e3, "ms", baseline=unfused * 1e3, ratio=unfused / t, params=p)
        b.record("hsic", "kernel_vs_unfused_bf16_grams", t * 1e3, "ms", baseline=unfused_bf16 * 1e3,
                 ratio=unfused_bf16 / t, params=p)
    extra = b.peak_extra_bytes(lambda: minibatch_hsic(x, None, True))
    if extra is not None:
        gram_bytes = num_layers * n * n * 4
        b.record("hsic", "kernel_peak_extra_memory", extra / 2**20, "MiB", baseline=gram_bytes / 2**20,
                 ratio=extra / gram_bytes, params={**params, "baseline": "L fp32 n x n Grams"})


def bench_token_entropy(b: Bench, sizes: dict, copy_gbs: float) -> None:
    from elsi_fast import metrics

    n, vocab = sizes["entropy"]
    params = {"n": n, "V": vocab, "dtype": "bf16"}
    logits = (torch.randn(n, vocab, device=b.device) * 3).to(torch.bfloat16)
    read_once = logits.numel() * 2 / (copy_gbs * 1e9)
    b.record("token_entropy", "read_once_at_copy_bandwidth", read_once * 1e3, "ms", params=params)

    def torch_chunked():
        os.environ["ELSI_FAST_DISABLE_TRITON"] = "1"
        try:
            metrics.token_entropy(logits)
        finally:
            del os.environ["ELSI_FAST_DISABLE_TRITON"]

    torch_time = b.time(torch_chunked)
    b.record("token_entropy", "torch_chunked", torch_time * 1e3, "ms", params=params)
    log_softmax_time = b.time(lambda: entropy_reference(logits, torch.float32))
    b.record("token_entropy", "torch_log_softmax_fp32", log_softmax_time * 1e3, "ms", params=params)
    configs = [default_entropy_tiles()]
    if not b.quick:
        configs += [EntropyTiles(2048, None, 4), EntropyTiles(8192, None, 16)]
    for i, tiles in enumerate(configs):
        t = b.time_tiles(lambda: token_entropy(logits, tiles=tiles), tiles)
        if t is None:
            continue
        p = {**params, "tiles": asdict(tiles), "default": i == 0}
        b.record("token_entropy", "kernel_vs_read_once", t * 1e3, "ms", baseline=read_once * 1e3,
                 ratio=t / read_once, params=p)
        b.record("token_entropy", "kernel_vs_torch_chunked", t * 1e3, "ms", baseline=torch_time * 1e3,
                 ratio=torch_time / t, params=p)
        b.record("token_entropy", "kernel_read_bandwidth", logits.numel() * 2 / t / 1e9, "GB/s", params=p)


def bench_linear_entropy(b: Bench, sizes: dict, matmul_tflops: float) -> None:
    n, dim, vocab = sizes["linear"]
    params = {"n": n, "d": dim, "V": vocab, "dtype": "bf16"}
    hidden = torch.randn(n, dim, device=b.device, dtype=torch.bfloat16)
    weight = (torch.randn(vocab, dim, device=b.device) * dim**-0.5 * 4).to(torch.bfloat16)

    def lm_head_then_entropy():
        return token_entropy(hidden @ weight.T)

    unfused = b.time(lambda: lm_head_then_entropy(), reps=max(2, b.reps // 2))
    b.record("linear_entropy", "lm_head_plus_token_entropy", unfused * 1e3, "ms", params=params)
    flops = 2 * n * dim * vocab
    configs = [default_linear_tiles(torch.bfloat16)]
    if not b.quick:
        configs += [LinearEntropyTiles(128, 256, 64, 8, 8, 3), LinearEntropyTiles(128, 128, 64, 8, 8, 4),
                    LinearEntropyTiles(256, 128, 64, 8, 8, 3)]
    for i, tiles in enumerate(configs):
        t = b.time_tiles(lambda: linear_token_entropy(hidden, weight, tiles=tiles), tiles, reps=max(2, b.reps // 2))
        if t is None:
            continue
        p = {**params, "tiles": asdict(tiles), "default": i == 0}
        b.record("linear_entropy", "kernel_vs_lm_head_plus_entropy", t * 1e3, "ms", baseline=unfused * 1e3,
                 ratio=unfused / t, params=p)
        tflops = flops / t / 1e12
        b.record("linear_entropy", "kernel_tflops_vs_matmul", tflops, "TFLOP/s", baseline=matmul_tflops,
                 ratio=tflops / matmul_tflops, params=p)
    logits_fp32 = n * vocab * 4
    for name, fn in (("kernel", lambda: linear_token_entropy(hidden, weight)),
                     ("lm_head_plus_entropy", lm_head_then_entropy)):
        extra = b.peak_extra_bytes(fn)
        if extra is not None:
            b.record("linear_entropy", f"{name}_peak_extra_memory", extra / 2**20, "MiB", baseline=logits_fp32 / 2**20,
                     ratio=extra / logits_fp32, params={**params, "baseline": "fp32 [n, V] logits"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: check the script (any machine)")
    parser.add_argument("--only", choices=["covariance", "hsic", "token_entropy", "linear_entropy"], nargs="*")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.quick:
        parser.error("needs a CUDA device (use --quick to check the script on CPU)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = QUICK if args.quick else FULL
    b = Bench(device, args.quick)
    copy_gbs, matmul_tflops = ceilings(b, sizes)
    only = set(args.only or ["covariance", "hsic", "token_entropy", "linear_entropy"])
    if "covariance" in only:
        bench_covariance(b, sizes, matmul_tflops)
    if "hsic" in only:
        bench_hsic(b, sizes)
    if "token_entropy" in only:
        bench_token_entropy(b, sizes, copy_gbs)
    if "linear_entropy" in only:
        bench_linear_entropy(b, sizes, matmul_tflops)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
