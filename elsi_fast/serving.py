"""Serving-engine config snippets for a chosen layer set (DESIGN.md section 2).

elsi-fast indexes hidden states input-to-layer: h_l is the input of block l (h_0 the embeddings,
h_N the last block's output before the final norm). vLLM and speculators use the same convention;
SGLang, SpecForge and TensorRT-LLM name a state by the block that *outputs* it, id = l - 1, so h_0
(which no block outputs) has no index there.
"""

from __future__ import annotations

from typing import Sequence

ENGINES = ("vllm", "speculators", "sglang", "specforge", "trtllm")
_OUTPUT_OF_LAYER = {"sglang", "specforge", "trtllm"}
# Engines whose EAGLE3 implementation accepts a number of aux layers other than 3.
_ANY_M = {
    "speculators": "speculators sizes the fc projection from the number of ids (num_aux)",
    "trtllm": "TensorRT-LLM captures any set given in eagle3_layers_to_capture",
    "sglang": "needs a recent SGLang that reads num_aux_hidden_states; older releases assume 3",
}
_ONLY_3 = {
    "vllm": "vLLM's EAGLE3 draft model hard-codes 3 aux hidden states (fc of width 3*d); serve m != 3 "
    "through a speculators-format checkpoint or another engine",
    "specforge": "SpecForge's EAGLE3 draft hard-codes 3 aux hidden states; train m != 3 elsewhere",
}


def _check_engine(engine: str) -> str:
    if not isinstance(engine, str) or engine.lower() not in ENGINES:
        raise ValueError(f"engine: expected one of {', '.join(ENGINES)}, got {engine!r}")
    return engine.lower()


def to_engine_layer_ids(layers: Sequence[int], engine: str, num_blocks: int | None = None) -> list[int]:
    """Convert input-to-layer indices to `engine`'s convention (l for vllm/speculators, l-1 else).

    Raises ValueError for h_0 with an output-of-layer engine (the embeddings are no block's
    output) and, when `num_blocks` is given, for indices outside 0..N.
    """
    engine = _check_engine(engine)
    layers = [int(l) for l in layers]
    if not layers:
        raise ValueError("layers: empty layer set")
    upper = num_blocks if num_blocks is not None else float("inf")
    bad = [l for l in layers if not 0 <= l <= upper]
    if bad:
        raise ValueError(f"layers: indices {bad} outside 0..{num_blocks} (input-to-layer convention)")
    if engine in _OUTPUT_OF_LAYER:
        if 0 in layers:
            raise ValueError(
                f"layers: h_0 (the token embeddings) has no output-of-layer index in {engine}; "
                "choose the selection without layer 0 or serve with vLLM/speculators"
            )
        return [l - 1 for l in layers]
    return layers


def engine_notes(layers: Sequence[int], engine: str, num_blocks: int) -> list[str]:
    """Caveats for serving `layers` (input-to-layer) with `engine`."""
    engine = _check_engine(engine)
    notes = []
    m = len(layers)
    if m != 3:
        if engine in _ONLY_3:
            notes.append(f"m={m}: {_ONLY_3[engine]}")
        else:
            notes.append(f"m={m}: {_ANY_M[engine]}")
    if num_blocks in layers:
        if engine == "trtllm":
            notes.append(f"h_{num_blocks} is the last block's output (id {num_blocks - 1}); check that your "
                         "TensorRT-LLM version captures the final layer")
        else:
            notes.append(f"h_{num_blocks} (last block output) is not captured: {engine} records aux states at the "
                         f"inputs of blocks 0..{num_blocks - 1} inside its layer loop; pick a set without it")
    if 0 in layers and engine in ("vllm", "speculators"):
        notes.append("h_0 (embeddings): vLLM records hidden_states + residual, and the residual is None before "
                     "block 0 in Llama-style models; check that your vLLM version handles layer 0")
    if len(set(layers)) != m:
        notes.append(f"layers {list(layers)} repeat a layer; the draft sees the same state twice")
    return notes


def serving_config(layers: Sequence[int], engine: str, num_blocks: int) -> dict:
    """The draft-config snippet that makes `engine` feed h_l for l in `layers` to the draft.

    vllm/speculators: top-level `eagle_aux_hidden_state_layer_ids` (input-to-layer);
    sglang/specforge: `eagle_config.eagle_aux_hidden_state_layer_ids` (output-of-layer);
    trtllm: `EagleDecodingConfig(eagle3_layers_to_capture=...)` fields (output-of-layer).
    """
    engine = _check_engine(engine)
    ids = to_engine_layer_ids(layers, engine, num_blocks)
    if engine in ("vllm", "speculators"):
        return {"eagle_aux_hidden_state_layer_ids": ids}
    if engine in ("sglang", "specforge"):
        config: dict = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}}
        if engine == "sglang" and len(ids) != 3:
            config["num_aux_hidden_states"] = len(ids)
        return config
    return {"decoding_type": "Eagle", "eagle3_layers_to_capture": ids}
