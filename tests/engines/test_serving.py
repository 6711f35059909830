"""Serving-config snippets (elsi_fast/engines/serving.py) against what each engine reads from them
(docs/method.md section 2); the id conventions themselves are tested in test_layer_ids.py."""

import pytest

from elsi_fast.engines.layer_ids import ENGINES, candidate_layers
from elsi_fast.engines.serving import engine_notes, serving_config

N = 36
EAGLE3 = [2, 18, 33]  # input-to-layer default [2, N//2, N-3]


def vllm_reads(config: dict, num_blocks: int) -> tuple[tuple[int, ...], int]:
    """(capture ids, fc width in states) as vLLM 0.32 resolves them from a draft config: capture ids
    from the top-level key, else eagle_config.layer_ids, else (2, N//2, N-3), sorted and
    de-duplicated; the fc width from num_aux_hidden_states, else the eagle_config id count, else 3."""
    eagle_config = config.get("eagle_config") or {}
    ids = config.get("eagle_aux_hidden_state_layer_ids") or eagle_config.get("layer_ids")
    ids = tuple(sorted(set(ids))) if ids else (2, num_blocks // 2, num_blocks - 3)
    width = config.get("num_aux_hidden_states")
    if width is None:
        nested = eagle_config.get("eagle_aux_hidden_state_layer_ids")
        width = len(nested) if nested else 3
    return ids, width


def sglang_reads(config: dict, num_blocks: int) -> tuple[tuple[int, ...], int]:
    """(captured states as input-to-layer ids, fc width) for SGLang 0.5.23: block id + 1 records its
    input; the fc width resolves like vLLM's."""
    eagle_config = config.get("eagle_config") or {}
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    captured = tuple(i + 1 for i in ids) if ids is not None else (2, num_blocks // 2, num_blocks - 3)
    width = config.get("num_aux_hidden_states") or (len(ids) if ids else 3)
    return captured, width


def llamacpp_reads(config: dict) -> tuple[int, ...]:
    """The capture ids llama.cpp (llama-cpp-python 0.3.36's vendored copy) takes from a draft GGUF's
    metadata: `eagle3.target_layers` as is, each id's block input copied into the fc input in turn
    (repeats allowed), and the model refused unless there are exactly 3 (src/models/eagle3.cpp)."""
    ids = tuple(config["eagle3.target_layers"])
    if len(ids) != 3:
        raise RuntimeError("EAGLE3 requires exactly 3 entries in 'extract_layers'")
    return ids


def test_input_to_layer_engines_keep_indices():
    assert serving_config(EAGLE3, "vllm", N) == {"eagle_aux_hidden_state_layer_ids": [2, 18, 33],
                                                 "num_aux_hidden_states": 3}
    assert serving_config(EAGLE3, "speculators", N) == {"eagle_aux_hidden_state_layer_ids": [2, 18, 33]}


def test_output_of_layer_engines_shift_by_one():
    # SpecForge's own default for N=36 is [1, N//2-1, N-4] = [1, 17, 32]: the same three states.
    assert serving_config(EAGLE3, "specforge", N) == {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 17, 32]}}
    assert serving_config(EAGLE3, "sglang", N)["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 17, 32]}
    assert serving_config(EAGLE3, "trtllm", N)["eagle3_layers_to_capture"] == [1, 17, 32]


@pytest.mark.parametrize("layers", [[9], [N], [4, 30], EAGLE3, [1, 5, 9, 20, 30]])
def test_vllm_snippet_alone_sets_capture_and_fc_width(layers):
    """Pasted into a draft config that has no other layer fields, the vLLM snippet gives vLLM the
    chosen states and an fc of m states (a bare id list gave m=1 drafts a 3-state fc)."""
    assert vllm_reads(serving_config(layers, "vllm", N), N) == (tuple(layers), len(layers))


@pytest.mark.parametrize("layers", [[9], [4, 30], EAGLE3, [1, 5, 9, 20, 30]])
def test_sglang_snippet_alone_sets_capture_and_fc_width(layers):
    assert sglang_reads(serving_config(layers, "sglang", N), N) == (tuple(layers), len(layers))


def test_bad_engine_and_range():
    with pytest.raises(ValueError, match="engine"):
        serving_config([1], "tgi", N)
    with pytest.raises(ValueError, match="outside 0..36"):
        serving_config([37], "vllm", N)


def test_every_candidate_of_an_engine_is_captured_there():
    for engine in ENGINES:
        candidates = candidate_layers(engine, 5)
        assert not any("not captured" in n for n in engine_notes(candidates, engine, 5)), engine
        serving_config(candidates[:3], engine, 5)  # every candidate has an id there


@pytest.mark.parametrize("engine", ENGINES)
def test_notes_for_m_not_3(engine):
    notes = engine_notes([9], engine, N)
    assert any(note.startswith("m=1") for note in notes)
    assert not any(note.startswith("m=") for note in engine_notes(EAGLE3, engine, N))
    refuses_m = any("accepts exactly 3" in n for n in notes)
    assert refuses_m == (engine == "specforge")


def test_last_layer_is_captured_by_vllm_and_speculators_only():
    for engine in ("vllm", "speculators"):
        assert engine_notes([2, 18, N], engine, N) == []
    for engine in ("sglang", "specforge", "trtllm"):
        assert any("not captured" in n for n in engine_notes([2, 18, N], engine, N))


def test_repeated_layers_are_not_servable():
    for engine in set(ENGINES) - {"llamacpp"}:
        notes = engine_notes([2, 2, 2], engine, N)
        assert any("fewer than m=3 states" in n for n in notes), engine
    assert vllm_reads(serving_config([2, 2, 2], "vllm", N), N)[0] == (2,)


@pytest.mark.parametrize("layers", [[9], [4, 30], EAGLE3, [0, 7, 7]])
def test_llamacpp_snippet_is_the_three_id_equivalent(layers):
    """m <= 3 is served as exactly 3 ids, the last repeated, which llama.cpp loads; the notes give the
    command that converts and serves, and name the equivalent for m < 3."""
    want = tuple(layers + [layers[-1]] * (3 - len(layers)))
    assert llamacpp_reads(serving_config(layers, "llamacpp", N)) == want
    notes = engine_notes(layers, "llamacpp", N)
    assert any("elsi-fast serve --draft DRAFT --engine llama.cpp" in n and "--spec-type draft-eagle3" in n
               and "-md draft.gguf" in n for n in notes)
    assert any(n.startswith(f"m={len(layers)}") and str(list(want)) in n for n in notes) == (len(layers) < 3)
    assert not any("fewer than m" in n for n in notes)  # a repeated id is legal there


def test_llamacpp_refuses_m_above_3_and_warns_on_last_layer():
    with pytest.raises(ValueError, match="exactly 3 target states"):
        serving_config([1, 5, 9, 20], "llamacpp", N)
    assert any("no m > 3 equivalent" in n for n in engine_notes([1, 5, 9, 20], "llamacpp", N))
    assert any("gpt-oss" in n and f"0..{N - 1}" in n for n in engine_notes([2, 18, N], "llamacpp", N))
    assert not any("gpt-oss" in n for n in engine_notes(EAGLE3, "llamacpp", N))
