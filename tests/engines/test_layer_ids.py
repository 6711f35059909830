"""Each engine's layer-id convention (docs/method.md section 2, elsi_fast/engines/layer_ids.py): known
answers for the conversions, the states each engine captures, and the EAGLE3 default ids."""

import pytest

from elsi_fast.engines.layer_ids import (ENGINES, candidate_layers, check_layer_set, common_candidate_layers,
                                         eagle3_default_layers, from_output_of_layer, llamacpp_layer_ids,
                                         to_engine_layer_ids, to_output_of_layer)

N = 36


def test_input_to_layer_engines_keep_ids_output_of_layer_engines_shift_by_one():
    for engine in ("vllm", "speculators", "llamacpp"):
        assert to_engine_layer_ids([2, 18, 33], engine, N) == [2, 18, 33]
    for engine in ("sglang", "specforge", "trtllm"):
        # SpecForge's own default for N=36 is [1, N//2-1, N-4] = [1, 17, 32]: the same three states.
        assert to_engine_layer_ids([2, 18, 33], engine, N) == [1, 17, 32]
    assert to_engine_layer_ids([1, N], "trtllm") == [0, N - 1]
    assert to_output_of_layer([1, 5, N]) == [0, 4, N - 1]
    assert from_output_of_layer([0, 4, N - 1]) == [1, 5, N]


def test_candidates_follow_the_engine():
    assert candidate_layers("vllm", 5) == [0, 1, 2, 3, 4, 5]
    assert candidate_layers("speculators", 5) == [0, 1, 2, 3, 4, 5]
    assert candidate_layers("llamacpp", 5) == [0, 1, 2, 3, 4]  # id N is zeros on Llama-family targets
    for engine in ("sglang", "specforge", "trtllm"):
        candidates = candidate_layers(engine, 5)
        assert candidates == [1, 2, 3, 4]
        assert to_engine_layer_ids(candidates, engine, 5) == [0, 1, 2, 3]  # every candidate has an index there
    assert common_candidate_layers(5) == [1, 2, 3, 4]
    assert set(ENGINES) == {"vllm", "speculators", "sglang", "specforge", "trtllm", "llamacpp"}
    with pytest.raises(ValueError, match="num_blocks"):
        candidate_layers("vllm", 0)


@pytest.mark.parametrize("engine", ["sglang", "specforge", "trtllm"])
def test_embeddings_have_no_output_of_layer_index(engine):
    with pytest.raises(ValueError, match="h_0"):
        to_engine_layer_ids([0, 5], engine)
    with pytest.raises(ValueError, match="h_0"):
        to_output_of_layer([0, 5])


def test_bad_engine_and_range():
    with pytest.raises(ValueError, match="engine: expected one of"):
        to_engine_layer_ids([1], "tgi")
    with pytest.raises(ValueError, match=r"outside 0..36"):
        to_engine_layer_ids([37], "vllm", N)
    with pytest.raises(ValueError, match="empty"):
        to_engine_layer_ids([], "vllm")


def test_eagle3_default_layers():
    assert eagle3_default_layers(36) == [2, 18, 33]
    assert eagle3_default_layers(32) == [2, 16, 29]
    assert eagle3_default_layers(5) == [2, 2, 2]  # the rule repeats a layer on small targets
    with pytest.raises(ValueError, match="num_blocks"):
        eagle3_default_layers(2)


def test_llamacpp_takes_three_ids_the_last_repeated():
    assert llamacpp_layer_ids([7]) == [7, 7, 7]
    assert llamacpp_layer_ids([4, 30]) == [4, 30, 30]
    assert llamacpp_layer_ids([2, 18, 33]) == [2, 18, 33]
    with pytest.raises(ValueError, match="exactly 3 target states"):
        llamacpp_layer_ids([1, 5, 9, 20])


def test_a_drafts_layer_set_is_increasing_and_within_the_target():
    assert check_layer_set((0, 3, 6), 6) == [0, 3, 6]
    with pytest.raises(ValueError, match="at least one"):
        check_layer_set([], 6)
    with pytest.raises(ValueError, match="strictly increasing"):
        check_layer_set([3, 2], 6)
    with pytest.raises(ValueError, match=r"0..6 \(input-to-layer, N=6\)"):
        check_layer_set([2, 7], 6)
