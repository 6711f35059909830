"""Builds the native draft-head extension `elsi_fast._C` beside the pure-Python package.

Environment switches (flash-attention style):
  ELSI_FAST_SKIP_NATIVE=1   build no extension; the torch reference paths are used.
  ELSI_FAST_FORCE_CUDA=1    build the CUDA sources even if torch reports no device (CI images
                            with a toolkit but no GPU); fails loudly if CUDA cannot be built.
  ELSI_FAST_SKIP_CUDA=1     build only the CPU extension even where CUDA is present.
CUDA code is built for sm_90 (H100/H200) unless TORCH_CUDA_ARCH_LIST names other architectures.
Build with `pip install --no-build-isolation .` so the installed torch is the one compiled against.
"""

import glob
import os

from setuptools import setup


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "true", "yes")


def native_extensions():
    if _flag("ELSI_FAST_SKIP_NATIVE"):
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:  # no torch at build time: install the pure-Python package
        return [], {}

    here = os.path.dirname(os.path.abspath(__file__))
    cpp_sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cu_sources = sorted(glob.glob(os.path.join("csrc", "*.cu")))
    if not cpp_sources:
        return [], {}

    want_cuda = not _flag("ELSI_FAST_SKIP_CUDA") and (
        _flag("ELSI_FAST_FORCE_CUDA")
        or (torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None)
    )
    # -O3 for the memory-bound CPU decode; ISA-specific code paths are compiled with per-function
    # target attributes and chosen at run time, so no -march=native here. Threads come from the
    # extension's own pool (csrc/common/cpu_pool.h), so no OpenMP runtime: -fopenmp-simd only honours
    # the `omp simd` loop pragmas.
    cxx_flags = ["-O3", "-fopenmp-simd", "-std=c++20", "-DNDEBUG"]
    link_flags = []
    if want_cuda:
        # Without TORCH_CUDA_ARCH_LIST torch would target every architecture it knows (slow builds
        # on GPU-less CI); the kernels need bf16 intrinsics (sm_80+) and are tuned for sm_90.
        arch_flags = [] if os.environ.get("TORCH_CUDA_ARCH_LIST") else ["-gencode=arch=compute_90,code=sm_90"]
        ext = cpp_extension.CUDAExtension(
            "elsi_fast._C",
            cpp_sources + cu_sources,
            include_dirs=[os.path.join(here, "csrc")],
            define_macros=[("ELSI_FAST_WITH_CUDA", "1")],
            extra_compile_args={
                "cxx": cxx_flags,
                "nvcc": ["-O3", "-std=c++17", *arch_flags],  # the .cu includes no torch headers
            },
            extra_link_args=link_flags,
        )
    else:
        ext = cpp_extension.CppExtension(
            "elsi_fast._C",
            cpp_sources,
            include_dirs=[os.path.join(here, "csrc")],
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_flags,
        )
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = native_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
