"""State files of long runs (the analysis pass, draft training, the toy target's training).

Two promises, for every run that saves state to disk:
- a crash mid-save leaves the previous state intact: `save_state` writes a temporary file and
  renames it into place;
- a state file never runs code: `load_state` reads with `torch.load(weights_only=True)`, which
  unpickles only tensors, numbers, strings, lists, tuples and dicts. A run folder can be shared or
  downloaded, and `--resume` on a crafted `state.pt` must not execute what it holds. States are
  therefore built from those types only (numpy arrays are stored as tensors).
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from typing import Any

import torch


def save_state(obj: Any, path: str | os.PathLike) -> None:
    """torch.save `obj` to `path` atomically (temporary file in the same folder, then os.replace)."""
    path = os.fspath(path)
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_state(path: str | os.PathLike, argument: str = "state_path") -> Any:
    """The object saved by `save_state`, read without executing code.

    Raises ValueError naming `argument` when the file holds anything but tensors and plain
    containers (a pickle of other objects is refused, never run) or is not a torch file at all.
    """
    path = os.fspath(path)
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive
        raise ValueError(f"{argument}: {path} is not a readable state file (not written by torch.save, or cut "
                         "short); delete it or start without resuming")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
        what = f" (it asks for {found.group(1)})" if found else ""
        raise ValueError(
            f"{argument}: {path} holds objects other than tensors and plain containers{what}, which elsi-fast never "
            "writes; it was not loaded (nothing in it was run): delete it or start without resuming"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(
            f"{argument}: {path} is not a readable state file ({' '.join(str(exc).split())[:200]}); "
            "delete it or start without resuming"
        ) from None
