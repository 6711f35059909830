"""Random Eagle3Draft weights shared by the draft tests."""

from __future__ import annotations

import math

import torch

from elsi_fast.draft import Eagle3Draft


def randomize_draft_(draft: Eagle3Draft, gen: torch.Generator) -> Eagle3Draft:
    """Fill every weight with random values (norm weights around 1, matrices scaled by 1/sqrt(fan_in))
    and pick a random sorted draft vocabulary, so d2t is a non-identity map."""
    cfg = draft.config
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if param.dim() == 1:  # every RMSNorm weight, variants' included
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[1]))
    draft.set_draft_vocab(torch.randperm(cfg.vocab_size, generator=gen)[: cfg.draft_vocab_size].sort().values)
    return draft
