"""A second Python environment with the serving/training packages elsi-fast interoperates with.

speculators 0.9.0 and SpecForge 0.2.0 pin torch / transformers versions that clash with this
project's, so they live in their own virtual environment, created on first use under
`.cache/engines-venv` (ignored by git) and reused while `ENGINE_REQUIREMENTS` is unchanged. Tests
run `engine_runner.py` inside it as a subprocess and compare its outputs with elsi-fast's in the
main process. Creating it needs the package registry; when that fails the tests fail under CI
(CI=true) and are skipped with the reason elsewhere.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV_DIR = REPO / ".cache" / "engines-venv"
RUNNER = Path(__file__).with_name("engine_runner.py")
# torch first, the CPU build this project uses; speculators and SpecForge without their declared
# dependencies, which would replace it (speculators' torchvision / torchaudio pull a CUDA torch;
# SpecForge pins torch 2.11, transformers 5.8.1 and sglang); then what their draft models import,
# within speculators' bounds.
ENGINE_REQUIREMENTS = (
    ("torch==2.13.0",),
    ("--no-deps", "speculators==0.9.0", "specforge==0.2.0"),
    ("transformers>=5.0,<=5.19.0", "datasets>=4.0,<=5.1.0", "hs-connectors==0.9.0", "pydantic>=2", "pydantic-settings",
     "loguru>=0.7.2,<=0.7.3", "openai>=2"),
)
_MARKER = ENV_DIR / "requirements.sha1"


def _requirements_key() -> str:
    return hashlib.sha1(repr((sys.version_info[:2], ENGINE_REQUIREMENTS)).encode()).hexdigest()


def _python() -> Path:
    return ENV_DIR / "bin" / "python"


def create_env() -> float:
    """Create (or reuse) the engines environment; returns the seconds spent creating it (0 if reused)."""
    key = _requirements_key()
    if _MARKER.is_file() and _MARKER.read_text() == key and _python().is_file():
        return 0.0
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(ENV_DIR)], check=True, capture_output=True, text=True)
    for requirement in ENGINE_REQUIREMENTS:
        result = subprocess.run([str(_python()), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                                 *requirement], capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"pip install {' '.join(requirement)} failed in {ENV_DIR}:\n{result.stderr[-3000:]}")
    _MARKER.write_text(key)
    return time.perf_counter() - start


def engines_python() -> Path:
    """The engines environment's interpreter; fails (CI) or skips (elsewhere) when it cannot be made."""
    try:
        seconds = create_env()
    except (RuntimeError, subprocess.CalledProcessError, OSError) as err:
        message = f"could not create the speculators / SpecForge environment: {err}"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    if seconds:
        print(f"\ncreated {ENV_DIR} in {seconds:.0f} s")
    return _python()


def run_jobs(python: Path, jobs_file: Path, timeout: float = 600) -> str:
    """Run the engine runner on a job file; its stderr is part of the error when it fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TORCHDYNAMO_DISABLE": "1", "PYTHONNOUSERSITE": "1"}
    env.pop("PYTHONPATH", None)
    result = subprocess.run([str(python), str(RUNNER), str(jobs_file)], capture_output=True, text=True,
                            timeout=timeout, env=env)
    if result.returncode:
        raise AssertionError(f"engine runner failed ({result.returncode}):\n{result.stdout[-2000:]}\n"
                             f"{result.stderr[-6000:]}")
    return result.stdout
