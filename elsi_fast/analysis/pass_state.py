"""What one rank of the analysis pass has accumulated: saved for resume, reduced across ranks.

A pass that stops (Ctrl-C, a crash) continues from its last saved state without counting a token
twice: the state records how many prompts of this rank's shard were consumed, and a fingerprint
of the model, the tokenized prompts and the pass settings, so that another run's state is refused.
Under torch.distributed every rank accumulates its shard and `reduce_across_ranks` gives every
rank the totals (the single-process result).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import nn

from .._infra.state_files import load_state
from ..streaming import MinibatchHSIC, StreamingCovariance
from .analysis_options import PASS_OPTIONS, AnalyzeOptions
from .prompt_store import PromptModeStore

STATE_VERSION = 3
# Prompts per broadcast when ranks exchange prompt-mode records.
_GATHER_PROMPTS = 16


class PassState:
    """Everything accumulated so far on this rank.

    factors_path: the prompt-mode factor file (None: an anonymous temporary file);
    filtered_only: no unfiltered prompt-mode statistics (the filter is off, nothing to compare)."""

    def __init__(
        self, num_layers: int, dim: int, normalize: str, device: torch.device, filtered_only: bool,
        factors_path: str | None, factors_dtype: torch.dtype,
    ):
        self.covariance = StreamingCovariance(num_layers, dim, normalize=normalize, device=device)
        self.hsic = MinibatchHSIC(num_layers, normalize=normalize, device=device)
        self.prompts = PromptModeStore(dim, factors_path, dtype=factors_dtype)
        # Unfiltered prompts serve only the variance comparison: per-layer statistics, no factors.
        self.prompts_unfiltered = None if filtered_only else PromptModeStore(dim, factors=False)
        self.position = 0  # prompts of this rank's shard already consumed
        self.tokens = {"total": 0, "candidates": 0, "kept": 0}
        self.prompts_without_hsic = 0
        self.seconds = 0.0  # forward time of the pass so far, over every run that resumed it

    def state_dict(self, fingerprint: str) -> dict:
        return {
            "version": STATE_VERSION,
            "fingerprint": fingerprint,
            "position": self.position,
            "tokens": dict(self.tokens),
            "prompts_without_hsic": self.prompts_without_hsic,
            "seconds": self.seconds,
            "covariance": self.covariance.state_dict(),
            "hsic": self.hsic.state_dict(),
            "prompts": self.prompts.state_dict(),
            "prompts_unfiltered": None if self.prompts_unfiltered is None else self.prompts_unfiltered.state_dict(),
        }

    def load(self, path: str, fingerprint: str) -> None:
        """Continue from the state file at `path` (ValueError if another run wrote it)."""
        state = load_state(path)
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION or state.get("fingerprint") != fingerprint:
            raise ValueError(
                f"state_path: {path} was written by a run with other prompts, model or options (or by another "
                "elsi-fast version); delete it or pass another state_path"
            )
        self.position = state["position"]
        self.tokens = dict(state["tokens"])
        self.prompts_without_hsic = state["prompts_without_hsic"]
        self.seconds = float(state.get("seconds", 0.0))  # states saved before it was kept: this run's time only
        self.covariance.load_state_dict(state["covariance"])
        self.hsic.load_state_dict(state["hsic"])
        self.prompts.load_state_dict(state["prompts"])
        if self.prompts_unfiltered is not None:
            self.prompts_unfiltered.load_state_dict(state["prompts_unfiltered"])


def pass_fingerprint(model: nn.Module, token_ids: list[list[int]], options: AnalyzeOptions) -> str:
    """What decides the pass's statistics: the model's class and config, the tokenized prompts and
    the pass settings (selection settings are applied after the pass and may change on resume)."""
    digest = hashlib.sha256()
    digest.update(type(model).__name__.encode())
    digest.update(json.dumps(getattr(model.config, "to_dict", dict)(), sort_keys=True, default=str).encode())
    digest.update(json.dumps(token_ids).encode())
    pass_options = {k: v for k, v in options.to_dict().items() if k in PASS_OPTIONS}
    digest.update(json.dumps(pass_options, sort_keys=True).encode())
    return digest.hexdigest()


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) under torch.distributed, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def reduce_across_ranks(state: PassState, factors_path: str | None) -> None:
    """Sum accumulators over ranks and gather every rank's prompt-mode records, so that all ranks
    hold the totals. Records travel by broadcast from each rank in turn, _GATHER_PROMPTS at a time
    (memory bounded); each rank writes the union to its own factor file."""
    import torch.distributed as dist

    state.covariance.all_reduce()
    state.hsic.all_reduce()
    local = {"tokens": state.tokens, "prompts_without_hsic": state.prompts_without_hsic,
             "counts": (len(state.prompts), 0 if state.prompts_unfiltered is None else len(state.prompts_unfiltered))}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    state.tokens = {key: sum(g["tokens"][key] for g in gathered) for key in state.tokens}
    state.prompts_without_hsic = sum(g["prompts_without_hsic"] for g in gathered)
    stores = [(state.prompts, PromptModeStore(state.prompts.dim, None if factors_path is None else f"{factors_path}.all",
                                              dtype=state.prompts.dtype))]
    if state.prompts_unfiltered is not None:
        stores.append((state.prompts_unfiltered, PromptModeStore(state.prompts.dim, factors=False)))
    rank = dist.get_rank()
    for which, (local_store, merged) in enumerate(stores):
        for source, g in enumerate(gathered):
            count = g["counts"][which]
            for start in range(0, count, _GATHER_PROMPTS):
                payload = [list(local_store.records(start, min(count, start + _GATHER_PROMPTS)))] if source == rank else [None]
                dist.broadcast_object_list(payload, src=source)
                for record in payload[0]:
                    merged.add_record(*record)
    state.prompts = stores[0][1]
    if state.prompts_unfiltered is not None:
        state.prompts_unfiltered = stores[1][1]
