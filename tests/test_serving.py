"""Serving-config index conventions (DESIGN.md section 2)."""

import pytest

from elsi_fast.serving import ENGINES, engine_notes, serving_config, to_engine_layer_ids

N = 36
EAGLE3 = [2, 18, 33]  # input-to-layer default [2, N//2, N-3]


def test_input_to_layer_engines_keep_indices():
    assert serving_config(EAGLE3, "vllm", N) == {"eagle_aux_hidden_state_layer_ids": [2, 18, 33]}
    assert serving_config(EAGLE3, "speculators", N) == {"eagle_aux_hidden_state_layer_ids": [2, 18, 33]}


def test_output_of_layer_engines_shift_by_one():
    # SpecForge's own default for N=36 is [1, N//2-1, N-4] = [1, 17, 32]: the same three states.
    assert serving_config(EAGLE3, "specforge", N) == {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 17, 32]}}
    assert serving_config(EAGLE3, "sglang", N) == {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 17, 32]}}
    assert serving_config(EAGLE3, "trtllm", N)["eagle3_layers_to_capture"] == [1, 17, 32]
    assert to_engine_layer_ids([1, N], "trtllm") == [0, N - 1]


def test_sglang_records_aux_count_for_m_not_3():
    assert serving_config([9], "sglang", N) == {
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [8]},
        "num_aux_hidden_states": 1,
    }


@pytest.mark.parametrize("engine", ["sglang", "specforge", "trtllm"])
def test_embeddings_have_no_output_of_layer_index(engine):
    with pytest.raises(ValueError, match="h_0"):
        to_engine_layer_ids([0, 5], engine)


def test_bad_engine_and_range():
    with pytest.raises(ValueError, match="engine"):
        to_engine_layer_ids([1], "tgi")
    with pytest.raises(ValueError, match="outside 0..36"):
        serving_config([37], "vllm", N)
    with pytest.raises(ValueError, match="empty"):
        to_engine_layer_ids([], "vllm")


@pytest.mark.parametrize("engine", ENGINES)
def test_notes_for_m_not_3(engine):
    notes = engine_notes([9], engine, N)
    assert any(note.startswith("m=1") for note in notes)
    assert not any(note.startswith("m=") for note in engine_notes(EAGLE3, engine, N))
    hard_coded = [n for n in notes if "hard-codes" in n]
    assert bool(hard_coded) == (engine in ("vllm", "specforge"))


def test_notes_for_last_layer_and_repeats():
    assert any("not captured" in n for n in engine_notes([2, 18, N], "vllm", N))
    assert any("not captured" in n for n in engine_notes([2, 18, N], "sglang", N))
    assert any("repeat" in n for n in engine_notes([2, 2, 2], "trtllm", N))
    assert any("h_0" in n for n in engine_notes([0, 2, 3], "vllm", N))
