"""Loading a target model: a named real target, a GGUF file, a transformers folder or hub id, a llama2.c `.bin`.

`load_model(source)` returns (model in eval mode, tokenizer) for any of
- a catalog name (`elsi_fast.targets.catalog`: "smollm2-135m-instruct", "gemma3-270m");
- a `.gguf` file, or a folder holding exactly one `.gguf` and no config.json: transformers'
  GGUF reader dequantizes it (tokenizer and chat template come from the file). The first load
  writes the dequantized float32 weights as a plain transformers folder into the cache
  (`dequantized_folder`), checked to reload to the same logits; later loads read that folder
  (seconds instead of the ~30 s the GGUF reader takes for SmolLM2 on 2 cores);
- a transformers model folder or a hub id;
- a llama2.c checkpoint.
`export_hf_folder` writes any loaded model as such a folder (what vLLM and llama.cpp's draft
converter want as the target). Every problem is a ValueError naming the argument; the CLI turns
it into one line and exit code 2. Nothing heavy is imported until a model is loaded, so the CLI's
checks (`describe_source`) stay fast.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._infra.cache import cache_root
from . import catalog

DTYPES = ("auto", "float32", "bfloat16", "float16")
# A hub id: "name" or "owner/name" of letters, digits, '.', '_', '-'; not a path or a checkpoint file.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_CHECKPOINT_SUFFIXES = (".bin", ".pt", ".pth", ".safetensors", ".gguf", ".json")
_GGUF_MAGIC = b"GGUF"
# Written last into a dequantized folder: its presence means the folder is complete and checked.
_DEQUANTIZED_MARKER = "elsi-fast-dequantized.json"
# Tokens of the logits check of an exported folder (any fixed ids inside the vocabulary).
_CHECK_TOKENS = 24


@dataclass(frozen=True)
class Source:
    """What a model argument names, found without loading it: kind is "gguf", "folder", "hub",
    "llama2c"; path the file or folder (None for a hub id); num_blocks when a header or config says."""

    kind: str
    path: Path | None
    num_blocks: int | None = None
    architecture: str | None = None


def looks_like_hub_id(name: str) -> bool:
    return bool(_HUB_ID.fullmatch(name)) and not name.endswith(_CHECKPOINT_SUFFIXES)


def describe_source(name: str, argument: str = "model") -> Source:
    """Classify and check a model argument without loading the model (no torch import).

    Resolves catalog names (assembling Gemma's chunks once), checks a GGUF file's header, tensor
    table and size, and a folder's config.json. ValueError naming `argument` for anything that
    cannot be a model."""
    if catalog.is_catalog_name(name):
        return inspect_gguf(catalog.resolve(name, argument), argument)
    path = Path(name)
    if path.is_dir():
        config = path / "config.json"
        if config.is_file():
            return Source("folder", path, _blocks_from_config(config, argument))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return inspect_gguf(ggufs[0], argument)
        if ggufs:
            raise ValueError(f"{argument}: folder {name} holds {len(ggufs)} .gguf files "
                             f"({', '.join(g.name for g in ggufs)}); name the file")
        raise ValueError(f"{argument}: folder {name} has no config.json and no .gguf file; give a transformers "
                         f"model folder, a .gguf file, a llama2.c .bin, a hub id or one of {', '.join(catalog.CATALOG)}")
    if path.is_file():
        if _read_magic(path) == _GGUF_MAGIC or path.suffix == ".gguf":
            return inspect_gguf(path, argument)
        from .llama2c import is_llama2c_checkpoint

        if is_llama2c_checkpoint(str(path)):
            return Source("llama2c", path)
        raise ValueError(f"{argument}: {name} is a file but neither a GGUF model nor a llama2.c checkpoint; give a "
                         "model folder, a .gguf file or a hub id")
    if path.exists():
        raise ValueError(f"{argument}: {name} is neither a file nor a folder")
    if not looks_like_hub_id(name):
        raise ValueError(f"{argument}: no such file or folder: {name}")
    return Source("hub", None)


def _read_magic(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(4)
    except OSError as exc:
        raise ValueError(f"cannot read {path} ({exc.strerror})") from None


def _blocks_from_config(config: Path, argument: str) -> int | None:
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{argument}: cannot read {config} ({' '.join(str(exc).split())})") from None
    data = data.get("text_config", data) if isinstance(data, dict) else {}
    blocks = data.get("num_hidden_layers")
    return blocks if isinstance(blocks, int) and blocks > 0 else None


def inspect_gguf(path: Path, argument: str = "model") -> Source:
    """Check a GGUF model file: magic, a readable header, every tensor inside the file (a truncated
    download fails here, not halfway through dequantizing) and an architecture with a block count.
    A file already dequantized into the cache was checked then: its folder answers (the full
    header parse takes ~7 s for SmolLM2's vocabulary arrays)."""
    path = Path(path)
    cached = _cached_folder(path)
    if cached is not None:
        marker = json.loads((cached / _DEQUANTIZED_MARKER).read_text())
        return Source("gguf", path, _blocks_from_config(cached / "config.json", argument), marker.get("architecture"))
    if _read_magic(path) != _GGUF_MAGIC:
        raise ValueError(f"{argument}: {path} is not a GGUF file (no GGUF magic); give a .gguf model file")
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ValueError(f"{argument}: reading {path.name} needs the `gguf` package: pip install gguf") from None
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors... on a damaged file
        raise ValueError(f"{argument}: {path} is a damaged or truncated GGUF file ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:160]}); download it again") from None
    size = path.stat().st_size
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size or not reader.tensors:
        raise ValueError(f"{argument}: {path} is truncated ({size} bytes, its tensors need {end}); download it again")
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{argument}: {path} has no general.architecture: not a model GGUF file")
    if _field(reader, "general.type") not in (None, "model"):
        raise ValueError(f"{argument}: {path} is a GGUF {_field(reader, 'general.type')!r} file, not a model")
    blocks = _field(reader, f"{arch}.block_count")
    return Source("gguf", path, int(blocks) if isinstance(blocks, int) else None, arch)


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.contents()
    return value


def _torch_dtype(dtype: str, device: str):
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype == "auto":
        return torch.bfloat16 if device != "cpu" else torch.float32
    return getattr(torch, dtype)


def load_model(source: str, *, device: str | None = None, dtype: str = "auto", argument: str = "model",
               device_argument: str = "device", progress: bool = True):
    """(model in eval mode, tokenizer) for `source` (see the module docstring).

    device: "cpu", "cuda", "cuda:N", or "auto" (device_map="auto": large models over several
    GPUs); default cuda when available. dtype: "auto" (bf16 on a GPU, fp32 on the CPU) or one of
    DTYPES; for a GGUF file, the precision its weights are dequantized to.
    """
    import torch

    where = describe_source(source, argument)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"{device_argument}: CUDA is not available on this machine; use cpu")
    torch_dtype = _torch_dtype(dtype, device)
    if where.kind == "llama2c":
        from .llama2c import load_llama2c, load_llama2c_tokenizer

        model = load_llama2c(str(where.path), dtype=torch_dtype)
        model = model.to("cpu" if device == "auto" else device)
        model.eval()
        return model, load_llama2c_tokenizer(str(where.path))
    folder = str(where.path) if where.path is not None else source
    if where.kind == "gguf":
        folder = str(dequantized_folder(where.path, argument, progress=progress))
    return _load_transformers(folder, source, device, torch_dtype, argument)


def _load_transformers(folder: str, source: str, device: str, torch_dtype, argument: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if device == "auto":
        kwargs["device_map"] = "auto"
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as exc:
        where = "the folder" if os.path.isdir(folder) else "not a local file or folder, and the hub id"
        raise ValueError(f"{argument}: {source}: {where} could not be loaded ({' '.join(str(exc).split())[:300]})") from None
    if device != "auto":
        model = model.to(device)
    model.eval()
    return model, tokenizer


def _file_key(path: Path) -> str:
    """sha256 of the file (the dequantized folder is valid for these exact bytes only)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def _folder_for(path: Path) -> Path:
    return cache_root() / "dequantized" / f"{path.stem}-{_file_key(path)}"


def _cached_folder(path: Path) -> Path | None:
    """The complete dequantized folder of this exact file in the cache, or None."""
    if not path.is_file():
        return None
    folder = _folder_for(path)
    return folder if (folder / _DEQUANTIZED_MARKER).is_file() else None


def gguf_tokenizer(gguf_path: str | os.PathLike):
    """The tokenizer of a GGUF file: from its dequantized folder when the cache holds one (fast), else
    transformers' GGUF reader (parses the vocabulary arrays, seconds)."""
    from transformers import AutoTokenizer

    path = Path(gguf_path)
    cached = _cached_folder(path)
    if cached is not None:
        return AutoTokenizer.from_pretrained(str(cached))
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def dequantized_folder(gguf_path: str | os.PathLike, argument: str = "model", *, progress: bool = True) -> Path:
    """The GGUF file as a plain transformers folder in float32 (exact: quantized values are
    scale x integer), written once into the cache and checked to reload to the same logits.

    transformers' GGUF reader is the reference dequantizer; an architecture it does not support is
    a ValueError naming `argument`."""
    cached = _cached_folder(Path(gguf_path))
    if cached is not None:
        return cached
    source = inspect_gguf(Path(gguf_path), argument)
    key = _file_key(source.path)
    final = _folder_for(source.path)
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / _DEQUANTIZED_MARKER).is_file():  # another process wrote it while we waited
            return final
        model, tokenizer = _read_gguf(source, argument, progress)
        partial = final.parent / f".{final.name}.partial"
        if partial.exists():
            shutil.rmtree(partial)
        export_hf_folder(model, tokenizer, partial)
        (partial / _DEQUANTIZED_MARKER).write_text(json.dumps(
            {"gguf": str(source.path), "sha256_prefix": key, "architecture": source.architecture}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
    return final


def _read_gguf(source: Source, argument: str, progress: bool):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    from transformers.utils import logging as hf_logging

    if source.architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{argument}: {source.path.name} has GGUF architecture {source.architecture!r}, which "
                         f"transformers' GGUF reader does not load (it reads "
                         f"{', '.join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ('general', 'tokenizer'))})")
    folder, name = str(source.path.parent), source.path.name
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:  # transformers raises many types on an unexpected tensor layout
        raise ValueError(f"{argument}: transformers could not read {source.path.name} "
                         f"({type(exc).__name__}: {' '.join(str(exc).split())[:300]})") from None
    finally:
        if not progress:
            hf_logging.enable_progress_bar()
    model.eval()
    return model, tokenizer


def export_hf_folder(model, tokenizer, path: str | os.PathLike, *, check: bool = True) -> Path:
    """Write `model` (any transformers causal LM, a GGUF-loaded one included) and `tokenizer` as a
    plain transformers folder: config.json without quantization_config, model.safetensors and
    the tokenizer files (chat template included). With `check`, the folder is reloaded and its
    logits on a fixed token sequence compared with `model`'s (ValueError if they differ).

    transformers refuses `save_pretrained` on a GGUF-loaded model ("quantized with gguf and is not
    serializable"), although its weights are plain dequantized tensors: so the weights go into a
    fresh model built from the config without the quantization entry."""
    import copy

    from transformers import AutoModelForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = ""
    dtype = next(model.parameters()).dtype
    fresh = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = fresh.load_state_dict(model.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"model: its weights do not match a fresh {type(fresh).__name__} (missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]})")
    fresh.tie_weights()
    fresh.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if check:
        _check_reload(model, out)
    return out


def _check_reload(model, folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=next(model.parameters()).dtype).eval()
    vocab = model.config.get_text_config().vocab_size
    ids = (torch.arange(_CHECK_TOKENS) * 7919 % vocab).unsqueeze(0).to(model.device)
    with torch.inference_mode():
        want = model(input_ids=ids).logits.float()
        got = reloaded.to(model.device)(input_ids=ids).logits.float()
    error = float((want - got).abs().max())
    if not error <= 1e-5 * max(1.0, float(want.abs().max())):
        raise ValueError(f"model: the exported folder {folder} reloads to different logits (max error {error:.3g})")


# Tokens that end generation wherever a vocabulary has them, the end-of-turn and end-of-text markers
# llama.cpp's vocabulary loader marks as end-of-generation (src/llama-vocab.cpp): a GGUF file names
# one eos id, while a chat model also ends its turn with another (Gemma's <end_of_turn>).
END_OF_GENERATION_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                           "<|end_of_text|>", "<|eom_id|>", "<EOT>", "<end_of_utterance>", "<eos>")


def end_of_generation_ids(tokenizer) -> list[int]:
    """The ids generation stops after, as llama.cpp stops: the tokenizer's eos id and every special
    token of `END_OF_GENERATION_TEXTS` its vocabulary holds, sorted. A ValueError when there is none."""
    special = {str(t) for t in tokenizer.all_special_tokens} | {
        str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    ids = {tokenizer.convert_tokens_to_ids(text) for text in END_OF_GENERATION_TEXTS if text in special}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    ids.discard(None)
    if not ids:
        raise ValueError("target: its tokenizer names no end-of-sequence or end-of-turn token")
    return sorted(ids)


def stop_token_ids(target, tokenizer) -> list[int]:
    """The ids that end the target's answer: its generation config's end-of-sequence ids and the
    tokenizer's (a chat model's end-of-turn token among them), sorted. Generation stops after the
    first of them, as serving engines do. (Kept as the data was made with it: the first id is what
    `regenerate` appends where llama.cpp left its end-of-generation token out.)"""
    ids = getattr(target.generation_config, "eos_token_id", None)
    ids = ids if isinstance(ids, list) else [ids]
    ids = [i for i in ids + [tokenizer.eos_token_id] if i is not None]
    if not ids:
        raise ValueError("target: neither its generation config nor its tokenizer names an end-of-sequence token")
    return sorted(set(ids))
