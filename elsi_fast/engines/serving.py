"""Serving-engine config snippets for a chosen layer set (docs/method.md section 2).

Layer ids are input-to-layer throughout (h_l = input of block l); `engines.layer_ids` holds each
engine's convention, what it captures and its fallbacks, and converts the ids for the snippets.

Architecture switches (`Eagle3Config` variants) each engine's EAGLE3 draft implements; a draft
with a switch its engine lacks is computed as the plain layer there:
* vLLM 0.32: norm_before_residual, norm_before_fc (top level or eagle_config), fc_norm,
  norm_output (= feed norm(h'') back), logit_scale, layer_types / sliding_window; a speculators
  config's switches are mapped onto these.
* speculators 0.9: norm_before_residual, norm_before_fc, fc_norm, norm_output (feed back),
  layer_types / sliding_window, Qwen3 layers (q/k norms).
* SGLang 0.5.23: norm_before_fc, fc_norm (or use_aux_norm), norm_output (feed back); not
  norm_before_residual; a draft window only from its server flag.
* SpecForge 0.2: fc_norm, norm_output (false = no final norm before lm_head); not
  norm_before_residual or norm_before_fc.
* llama.cpp: norm_before_residual, norm_before_fc (the GGUF writer refuses the others).
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

from .layer_ids import (CAPTURES_LAST, ENGINES, LLAMACPP_LAYERS, check_engine, llamacpp_layer_ids,
                        to_engine_layer_ids)

_M_NOTES = {
    "vllm": "vLLM 0.32 sizes fc from num_aux_hidden_states (in this snippet), any m",
    "speculators": "speculators 0.9 sizes fc from the number of ids, any m",
    "sglang": "SGLang 0.5.23 sizes fc from num_aux_hidden_states (in this snippet), any m",
    "specforge": "SpecForge 0.2 accepts exactly 3 capture layers and builds a 3-state fc; train m != 3 with "
                 "elsi-fast and serve it with vLLM, speculators or SGLang",
    "trtllm": "TensorRT-LLM captures the layers listed in eagle3_layers_to_capture",
}
_LLAMACPP_SERVE = ("serve a trained draft with `elsi-fast serve --draft DRAFT --engine llama.cpp --target target.gguf` "
                   "(it writes the draft GGUF and starts llama-server -m target.gguf -md draft.gguf --spec-type "
                   "draft-eagle3 --spec-draft-n-max K)")


def engine_notes(layers: Sequence[int], engine: str, num_blocks: int) -> list[str]:
    """Caveats for serving `layers` (input-to-layer) with `engine`."""
    engine = check_engine(engine)
    if engine == "llamacpp":
        return _llamacpp_notes(list(layers), num_blocks)
    notes = []
    m = len(layers)
    if m != 3:
        notes.append(f"m={m}: {_M_NOTES[engine]}")
    if num_blocks in layers and engine not in CAPTURES_LAST:
        notes.append(f"h_{num_blocks} (last block output) is not captured by {engine}: it records aux states at the "
                     f"inputs of blocks 0..{num_blocks - 1}; pick a set without it or serve with vLLM/speculators")
    if len(set(layers)) != m:
        notes.append(f"layers {list(layers)} repeat a layer: engines capture each layer once (vLLM 0.32 sorts and "
                     f"de-duplicates the ids), so the draft would get fewer than m={m} states; not servable as is")
    return notes


def _llamacpp_notes(layers: list[int], num_blocks: int) -> list[str]:
    m = len(layers)
    if m > LLAMACPP_LAYERS:
        return [f"m={m}: llama.cpp takes exactly {LLAMACPP_LAYERS} target layers and has no m > 3 equivalent; "
                f"select m <= 3 or serve with vLLM/speculators"]
    notes = []
    if m < LLAMACPP_LAYERS:
        notes.append(f"m={m}: llama.cpp takes exactly {LLAMACPP_LAYERS} target layers; the draft is served as its "
                     f"exact 3-id equivalent {llamacpp_layer_ids(layers)} (zero fc columns for the repeats, so the "
                     f"m={m} saving in fc and capture is lost, the layer choice kept)")
    if num_blocks in layers:
        notes.append(f"h_{num_blocks} (last block output) is delivered by llama.cpp only on gpt-oss targets: Llama-family "
                     f"graphs hand the draft zeros for id {num_blocks}, MTP graphs the final-normed state; pick a set "
                     f"in 0..{num_blocks - 1}")
    notes.append(_LLAMACPP_SERVE)
    return notes


def serving_config(layers: Sequence[int], engine: str, num_blocks: int) -> dict:
    """The draft-config snippet that makes `engine` feed h_l for l in `layers` to the draft, for any m.

    vllm: top-level `eagle_aux_hidden_state_layer_ids` (input-to-layer) and `num_aux_hidden_states`
    (the fc width, else vLLM falls back to 3); speculators: the top-level ids (their count is the fc
    width); sglang: `eagle_config.eagle_aux_hidden_state_layer_ids` (output-of-layer) and
    `num_aux_hidden_states`; specforge: the eagle_config ids; trtllm:
    `EagleDecodingConfig(eagle3_layers_to_capture=...)` fields (output-of-layer); llamacpp: the
    draft GGUF's `eagle3.target_layers` (input-to-layer, m <= 3 padded to the 3-id equivalent; the
    GGUF export writes it).
    """
    engine = check_engine(engine)
    ids = to_engine_layer_ids(layers, engine, num_blocks)
    if engine == "llamacpp":
        return {"eagle3.target_layers": llamacpp_layer_ids(ids)}
    if engine == "vllm":
        return {"eagle_aux_hidden_state_layer_ids": ids, "num_aux_hidden_states": len(ids)}
    if engine == "speculators":
        return {"eagle_aux_hidden_state_layer_ids": ids}
    if engine == "sglang":
        return {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}, "num_aux_hidden_states": len(ids)}
    if engine == "specforge":
        return {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}}
    return {"decoding_type": "Eagle", "eagle3_layers_to_capture": ids}


def serving_configs(report: Any) -> dict[str, dict]:
    """Every selection of a `LayerReport` (all methods and m) for every engine, with its caveats:
    "method/m=M/engine" -> {"layers", "config" (None where the engine cannot serve it), "notes"}."""
    configs = {}
    for method, by_m in report.selections.items():
        for m in sorted(by_m, key=int):
            layers = report.select(method, int(m))
            for engine in ENGINES:
                key = f"{method}/m={m}/{engine}"
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        config = report.serving_config(engine, m=int(m), method=method)
                    configs[key] = {"layers": layers, "config": config,
                                    "notes": report.serving_notes(engine, int(m), method)}
                except ValueError as exc:  # e.g. h_0 in an output-of-layer engine
                    configs[key] = {"layers": layers, "config": None, "notes": [str(exc)]}
    return configs
