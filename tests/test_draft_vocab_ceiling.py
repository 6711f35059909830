"""bench.draft_vocab_ceiling's perfect-draft rounds against hand-counted decodings."""

from __future__ import annotations

import pytest

from bench.draft_vocab_ceiling import ceiling_rounds


@pytest.mark.parametrize("answer, vocabulary, k, expected", [
    # every token drafted: rounds of k + 1 after the prefill's token; the last round is cut to what is left
    ([5, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], {1}, 4, (10, 2)),
    # nothing drafted: one token per round
    ([5, 7, 7, 7], {1}, 4, (3, 3)),
    # a round ends at the first token outside the vocabulary, which the target emits itself
    ([5, 1, 1, 9, 1, 1, 1, 1, 1], {1}, 4, (8, 2)),
    # k = 1
    ([5, 1, 1, 1, 1], {1}, 1, (4, 2)),
    # a one-token answer has no verification round
    ([5], {1}, 4, (0, 0)),
])
def test_rounds_of_a_perfect_draft(answer, vocabulary, k, expected):
    assert ceiling_rounds(answer, vocabulary, k) == expected
