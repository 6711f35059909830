import random

import pytest

from elsi_fast.decoding.prompt_lookup import PromptLookup, lookup_matches


def reference_proposal(context, n, k):
    """Brute force: search the context backwards for an earlier occurrence of its last n tokens,
    then copy what followed it token by token, the copied tokens included (LZ77)."""
    if len(context) <= n:
        return []
    for j in reversed(range(len(context) - n)):
        if context[j : j + n] == context[-n:]:
            sequence = list(context)
            for i in range(k):
                sequence.append(sequence[j + n + i])
            return sequence[len(context) :]
    return []


def reference_matches(ids, first, n, k):
    matches, found = [0] * len(ids), [False] * len(ids)
    for t in range(max(0, first), len(ids) - 2):
        proposal = reference_proposal(ids[: t + 2], n, k)
        found[t] = bool(proposal)
        for a, b in zip(proposal, ids[t + 2 :]):
            if a != b:
                break
            matches[t] += 1
    return matches, found


def test_proposal_known_answers():
    assert PromptLookup(2, [5, 6, 7, 8, 5, 6]).propose(3) == [7, 8, 5]
    assert PromptLookup(2, [1, 2, 9, 1, 2, 4, 1, 2]).propose(1) == [4]  # the latest occurrence wins
    assert PromptLookup(2, [3, 4]).propose(2) == []  # the last n-gram itself is no occurrence
    assert PromptLookup(2, [1, 2, 3]).propose(4) == []
    assert PromptLookup(1, [7, 7, 7]).propose(5) == [7] * 5  # a run goes on past the sequence's end
    assert PromptLookup(2, [5, 6, 7, 8, 5, 6]).propose(7) == [7, 8, 5, 6, 7, 8, 5]  # so does a loop


def test_extend_equals_building_at_once():
    rng = random.Random(0)
    ids = [rng.randrange(4) for _ in range(200)]
    grown = PromptLookup(3)
    for c in range(len(ids)):
        grown.extend(ids[c : c + 1])
        assert grown.propose(5) == reference_proposal(ids[: c + 1], 3, 5) == PromptLookup(3, ids[: c + 1]).propose(5)


def test_matches_on_a_repeated_passage():
    passage = [11, 12, 13, 14, 15, 16, 17, 18]
    ids = [1, 2] + passage + passage
    matches, found = lookup_matches(ids, 9, n=3, k=4)  # the prompt is the first copy
    # t = 9, 10: the contexts end in 3-grams not seen before; from t = 11 on the lookup copies, the
    # last chain starts running out of continuation
    assert found == [False] * 11 + [True] * 5 + [False] * 2
    assert matches == [0] * 11 + [4, 4, 3, 2, 1, 0, 0]


@pytest.mark.parametrize("n,k", [(1, 1), (2, 4), (3, 4), (4, 5)])
@pytest.mark.parametrize("vocab", [3, 7, 50])
def test_matches_equal_the_brute_force(n, k, vocab):
    rng = random.Random(n * 100 + k * 10 + vocab)
    for _ in range(20):
        length = rng.randint(1, 60)
        ids = [rng.randrange(vocab) for _ in range(length)]
        first = rng.randint(0, max(0, length - 1))
        assert lookup_matches(ids, first, n, k) == reference_matches(ids, first, n, k)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_n_and_k_are_refused(bad):
    with pytest.raises(ValueError, match="^n: "):
        PromptLookup(bad)
    with pytest.raises(ValueError, match="^k: "):
        PromptLookup(2, [1, 2, 3]).propose(bad)
    with pytest.raises(ValueError, match="^k: "):
        lookup_matches([1, 2, 3], 0, 2, bad)
