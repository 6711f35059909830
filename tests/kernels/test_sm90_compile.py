"""The kernels compile for Hopper (sm_90) with the installed Triton, no GPU needed.

The interpreter runs the kernels' arithmetic but not the compiler: this catches constructs that only
fail in code generation, and checks that the default bf16 launch shapes of the GEMM-like kernels use
wgmma with cp.async-pipelined loads and that streaming loads are 16-byte vectors. The compiler runs in
a subprocess because this process has TRITON_INTERPRET=1 set (conftest) before the kernels load.
Signatures mirror what Triton's JIT specializes at run time for aligned inputs with widths that are
multiples of 16 (pointers and such integers carry tt.divisibility 16).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

COMPILE_SCRIPT = r'''
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from elsi_fast.kernels import _layer_table, covariance, entropy, hsic

ROWS = dict(x0="*bf16", offsets="*i64", row_strides="*i64", dims="*i64", rows="*i64")

def compile_ptx(fn, pointers, constexprs, aligned_ints=(), num_warps=4, num_stages=3):
    signature = {}
    for name in fn.arg_names:
        signature[name] = "constexpr" if name in constexprs else pointers.get(name, "i32")
    divisible = [n for n in fn.arg_names if signature[n].startswith("*") or n in aligned_ints]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    ptx = kernel.asm["ptx"]
    return {
        "wgmma": "wgmma.mma_async" in ptx,
        "cp_async_16B": len(re.findall(r"cp\.async\.cg\.shared\.global \[[^\]]*\], \[[^\]]*\], 0x10", ptx)),
        "ld_v4": ptx.count("ld.global.v4"),
        "ld_scalar_b16": ptx.count("ld.global.b16"),
        "st_v4": ptx.count("st.global.v4"),
    }

out = {}
COV = dict(ROWS, inv_norm="*fp32", shift="*fp32", sum_xx="*fp32", sum_x="*fp32")
out["covariance"] = compile_ptx(
    covariance._covariance_kernel, COV,
    dict(PACKED=True, HAS_ROWS=False, NORMALIZE=False, USE_TC=True, ALIGN=8, BLOCK_D=128, BLOCK_N=64),
    aligned_ints=("dim",), num_warps=8)
out["covariance_fused"] = compile_ptx(
    covariance._covariance_kernel, COV,
    dict(PACKED=False, HAS_ROWS=True, NORMALIZE=True, USE_TC=True, ALIGN=8, BLOCK_D=128, BLOCK_N=64),
    aligned_ints=("dim",), num_warps=8)
out["covariance_fp32"] = compile_ptx(
    covariance._covariance_kernel, dict(COV, x0="*fp32"),
    dict(PACKED=False, HAS_ROWS=False, NORMALIZE=False, USE_TC=False, ALIGN=4, BLOCK_D=64, BLOCK_N=32),
    aligned_ints=("dim",))
out["covariance_pack"] = compile_ptx(
    covariance._pack_kernel, dict(ROWS, shift="*fp32", packed="*bf16", col_sums="*fp32"),
    dict(HAS_ROWS=True, NORMALIZE=True, ALIGN=8, BLOCK_R=32, BLOCK_D=256), aligned_ints=("dim",))
out["hsic_gram_tiles"] = compile_ptx(
    hsic._gram_tiles_kernel,
    dict(ROWS, inv_norm="*fp32", mean="*fp32", tile_rows="*i32", tile_cols="*i32", work="*fp32", sq_norms="*fp32"),
    dict(HAS_ROWS=True, NORMALIZE=True, USE_TC=True, ALIGN=8, BLOCK_N=128, BLOCK_K=64), num_warps=8)
out["hsic_col_sums"] = compile_ptx(
    hsic._col_sum_kernel, dict(ROWS, inv_norm="*fp32", out="*fp32"),
    dict(HAS_ROWS=True, NORMALIZE=True, ALIGN=8, BLOCK_R=32, BLOCK_D=256))
out["row_inv_norms"] = compile_ptx(
    _layer_table._inv_norm_kernel, dict(ROWS, inv_out="*fp32"), dict(HAS_ROWS=False, ALIGN=8, BLOCK_R=16, BLOCK_D=256))
for final in (True, False):
    out[f"token_entropy_final_{final}"] = compile_ptx(
        entropy._entropy_kernel, dict(x="*bf16", row_offsets="*i64", stats="*fp32", out="*fp32"),
        dict(FINAL=final, ALIGN=8, BLOCK_V=4096, stride_v=1), aligned_ints=("vocab", "split_cols"), num_warps=8)
out["linear_entropy"] = compile_ptx(
    entropy._linear_entropy_kernel, dict(h="*bf16", w="*bf16", bias="*bf16", stats="*fp32"),
    dict(HAS_BIAS=True, USE_TC=True, BLOCK_M=128, BLOCK_V=128, BLOCK_K=64, GROUP_M=8),
    aligned_ints=("stride_h", "stride_w", "dim", "vocab"), num_warps=8)
out["linear_entropy_fp32"] = compile_ptx(
    entropy._linear_entropy_kernel, dict(h="*fp32", w="*fp32", bias="*fp32", stats="*fp32"),
    dict(HAS_BIAS=False, USE_TC=False, BLOCK_M=64, BLOCK_V=64, BLOCK_K=32, GROUP_M=8),
    aligned_ints=("stride_h", "stride_w", "dim"))
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def ptx_summary() -> dict:
    pytest.importorskip("triton.backends.nvidia", reason="this Triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_gemm_kernels_use_wgmma_with_pipelined_loads(ptx_summary):
    for name in ("covariance", "covariance_fused", "hsic_gram_tiles", "linear_entropy"):
        assert ptx_summary[name]["wgmma"], name
        assert ptx_summary[name]["cp_async_16B"] > 0, name
        assert ptx_summary[name]["ld_scalar_b16"] == 0, name


def test_fp32_paths_compile_without_tensor_cores(ptx_summary):
    for name in ("covariance_fp32", "linear_entropy_fp32"):
        assert not ptx_summary[name]["wgmma"], name


def test_streaming_kernels_load_16_byte_vectors(ptx_summary):
    for name in ("token_entropy_final_True", "token_entropy_final_False", "row_inv_norms", "hsic_col_sums",
                 "covariance_pack"):
        assert ptx_summary[name]["ld_v4"] > 0, name
        assert ptx_summary[name]["ld_scalar_b16"] == 0, name
    assert ptx_summary["covariance_pack"]["st_v4"] > 0
