"""Prompt lookup: n-gram proposals read from the sequence itself, alone or in front of a draft.

After the tokens x_0 .. x_{c-1}, the proposal is the k tokens that followed the latest earlier
occurrence of their last n tokens (one that starts at j < c - n), and nothing when those n tokens
have not occurred before. Past x_{c-1} the copy reads on into its own proposal, as an LZ77 copy
does: token i is x_{c+i-d} at the distance d = c - n - j, so a run or a loop of period d (a small
model repeating a phrase) is proposed k tokens long rather than cut after d. It is the draftless
drafting that llama.cpp (`--spec-type ngram-*`, `llama-lookup`) and transformers
(`prompt_lookup_num_tokens`) ship.

Why elsi-fast has it: greedy targets copy from their prompt and repeat themselves, and on those
tokens the kept EAGLE3 drafts are often wrong where the lookup is right (docs/real-models.md,
"Copying"). `speculative.speculative_loop(prompt_lookup=n)` therefore proposes the lookup's
tokens in a round whose n-gram has occurred before and the draft's in every other round; the
output is still the target's greedy decoding. `lookup_matches` measures the lookup along a fixed
greedy continuation the way `evaluation.replay_runs_per_k` measures a draft, so the replayed tau of
the combination equals the live one.
"""

from __future__ import annotations

from typing import Iterable, Sequence


class PromptLookup:
    """An n-gram index of a growing token sequence: `extend` appends tokens (O(n) each), `propose(k)`
    reads the proposal after the current last token (see the module docstring)."""

    def __init__(self, n: int, tokens: Iterable[int] = ()) -> None:
        _check_positive("n", n)
        self.n = n
        self.tokens: list[int] = []
        self._latest: dict[tuple[int, ...], int] = {}  # n-gram -> its latest start j <= len - n - 1
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        n = self.n
        for token in tokens:
            self.tokens.append(int(token))
            start = len(self.tokens) - n - 1  # the n-gram just before the last one is now "earlier"
            if start >= 0:
                self._latest[tuple(self.tokens[start : start + n])] = start

    def propose(self, k: int) -> list[int]:
        """`k` tokens; [] when the last n tokens have not occurred before."""
        _check_positive("k", k)
        c, n = len(self.tokens), self.n
        if c <= n:
            return []
        start = self._latest.get(tuple(self.tokens[c - n :]))
        if start is None:
            return []
        proposal = self.tokens[start + n : start + n + k]
        while len(proposal) < k:  # the copy at distance c - n - start reads on into itself
            proposal.append(proposal[len(proposal) - (c - n - start)])
        return proposal


def lookup_matches(ids: Sequence[int], first: int, n: int, k: int) -> tuple[list[int], list[bool]]:
    """Along the sequence `ids` (prompt, then the target's greedy continuation), for every chain
    start t from `first` (the prompt's last position) to len(ids) - 3, with the context ids[: t + 2]:
    (L(t), found(t)): how many leading tokens of its proposal equal ids[t + 2 :], and whether it
    proposed anything. Both are 0 / False at the other positions."""
    _check_positive("k", k)
    ids = [int(i) for i in ids]
    length = len(ids)
    matches, found = [0] * length, [False] * length
    first = max(0, first)
    lookup = PromptLookup(n, ids[: first + 2])
    for t in range(first, length - 2):
        if t > first:
            lookup.extend(ids[t + 1 : t + 2])
        proposal = lookup.propose(k)
        if proposal:
            found[t] = True
            for step, token in enumerate(proposal):
                if t + 2 + step >= length or token != ids[t + 2 + step]:
                    break
                matches[t] += 1
    return matches, found


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
