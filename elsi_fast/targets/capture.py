"""Capture the residual stream h_0 .. h_N of a Hugging Face causal LM with forward hooks.

Layer convention (docs/method.md section 2, "input-to-layer"): h_0 is the input of block 0 (the token
embeddings, after any model-specific scaling or position embeddings), h_l is the input of block l
= output of block l-1, and h_N is the output of the last block *before* the final norm. Hugging
Face's `output_hidden_states[N]` is taken after the final norm, so h_N comes from a hook on the
last block instead.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

# Attribute paths of the decoder-block list in common architectures, relative to the model
# (a *ForCausalLM) or to its base model. Checked first; the generic search below is the fallback.
_KNOWN_BLOCK_PATHS = (
    "model.layers",  # Llama, Mistral, Qwen2/3, Gemma, Phi-3, ...
    "layers",
    "transformer.h",  # GPT-2, GPT-J, Falcon, Bloom
    "h",
    "gpt_neox.layers",  # GPT-NeoX, Pythia
    "model.decoder.layers",  # OPT
    "decoder.layers",
    "transformer.blocks",  # MPT
    "blocks",
)


def _get_path(module: nn.Module, path: str) -> nn.Module | None:
    for name in path.split("."):
        module = getattr(module, name, None)
        if module is None:
            return None
    return module


def _is_block_list(module: object) -> bool:
    return (
        isinstance(module, nn.ModuleList)
        and len(module) > 0
        and len({type(block) for block in module}) == 1
    )


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of N decoder blocks of `model`, in depth order.

    Known attribute paths are tried first; otherwise the largest `nn.ModuleList` of identical
    modules whose length equals `config.num_hidden_layers` (when the config has it) is used.
    Raises TypeError naming the model's class when no block list can be found.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    config = getattr(model, "config", None)
    expected = getattr(config, "num_hidden_layers", None) if config is not None else None
    for path in _KNOWN_BLOCK_PATHS:
        blocks = _get_path(model, path)
        if _is_block_list(blocks) and (expected is None or len(blocks) == expected):
            return blocks
    candidates = [
        module
        for module in model.modules()
        if _is_block_list(module) and (expected is None or len(module) == expected)
    ]
    if not candidates:
        raise TypeError(
            f"model: cannot find the decoder blocks of {type(model).__name__} (no nn.ModuleList "
            f"of identical blocks{'' if expected is None else f' of length num_hidden_layers={expected}'}); "
            "supported: Llama/Mistral/Qwen/Gemma/GPT-NeoX/GPT-2 style models"
        )
    return max(candidates, key=len)


def _block_input(args: tuple, kwargs: dict) -> torch.Tensor:
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"cannot read the hidden states passed to a decoder block (got {type(hidden).__name__})")
    return hidden


def _block_output(output: object) -> torch.Tensor:
    # transformers 5.x blocks return a tensor; 4.x and many remote-code models return a tuple.
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"cannot read the hidden states returned by a decoder block (got {type(output).__name__})")


class HiddenStateCapture:
    """Result of `capture_hidden_states`: `.states[l]` is h_l as [B, T, d] (without a callback)."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.states: dict[int, torch.Tensor] = {}


@contextlib.contextmanager
def capture_hidden_states(
    model: nn.Module,
    layers: Sequence[int] | None = None,
    callback: Callable[[int, torch.Tensor], None] | None = None,
    stop: bool = False,
) -> Iterator[HiddenStateCapture]:
    """Record h_l for l in `layers` (default 0..N) during the forward passes run inside the block.

    Without `callback`, `.states[l]` holds the last forward's h_l [B, T, d] (detached). With
    `callback(l, h_l)`, each state is handed over as soon as it is produced and nothing is kept,
    so a streaming consumer decides what to retain. Hooks are removed on exit. With `stop`, the
    forward ends once the deepest of `layers` is captured (the blocks above it and the head never
    run: a reader of h_11 of 30 blocks pays for 11), and so does the `with` block: run the forward
    as its last statement.
    """
    blocks = decoder_layers(model)
    num_blocks = len(blocks)
    wanted = list(range(num_blocks + 1)) if layers is None else sorted(set(int(l) for l in layers))
    bad = [l for l in wanted if not 0 <= l <= num_blocks]
    if bad:
        raise ValueError(f"layers: indices {bad} out of range 0..{num_blocks} (N={num_blocks} blocks)")
    capture = HiddenStateCapture(num_blocks)
    deepest = wanted[-1] if stop and wanted else None

    def emit(index: int, hidden: torch.Tensor) -> None:
        hidden = hidden.detach()
        if callback is not None:
            callback(index, hidden)
        else:
            capture.states[index] = hidden
        if index == deepest:
            raise _ForwardStopped

    handles = []
    try:
        if 0 in wanted:
            handles.append(
                blocks[0].register_forward_pre_hook(
                    lambda _m, args, kwargs: emit(0, _block_input(args, kwargs)), with_kwargs=True
                )
            )
        for index in wanted:
            if index == 0:
                continue
            handles.append(
                blocks[index - 1].register_forward_hook(
                    lambda _m, _args, output, index=index: emit(index, _block_output(output))
                )
            )
        yield capture
    except _ForwardStopped:
        pass
    finally:
        for handle in handles:
            handle.remove()


class _ForwardStopped(Exception):
    """Raised by `capture_hidden_states(stop=True)` at the deepest wanted layer, caught on exit."""


def plain_lm_head(model: nn.Module) -> nn.Linear | None:
    """The LM head as a plain Linear when logits = head(final normed hidden state) exactly, else
    None (soft-capped or scaled logits need the model's own logits). What lets the analysis compute
    token entropies, and draft training soft labels, from the final normed states alone."""
    config = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, attr, None) not in (None, 1.0):
            return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head if isinstance(head, nn.Linear) else None
