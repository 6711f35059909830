"""The settings of one analysis and their defaults: the one place they are defined.

`analyze`'s keyword arguments, the `elsi-fast analyze` flags and a report's `options` all take
their defaults from `AnalyzeOptions`. This module imports neither torch nor numpy, so the CLI's
`--help` and argument checks can read it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from ..engines.layer_ids import common_candidate_layers

# Default token-entropy threshold (nats). Measured with `python -m bench.bench_analysis --part threshold`
# (docs/real-models.md, "Token-entropy filter"): the threshold must lower the cross-prompt variance
# of per-layer entropy at equal token counts without dropping many tokens. Every report prints the
# variance with and without the filter, so a model where filtering hurts is visible (then pass 0).
DEFAULT_MIN_TOKEN_ENTROPY = 0.5

# Settings that change the statistics of the pass (a resumed run must match them); the others
# only change the selection after it and may differ between an interrupted run and its resume.
PASS_OPTIONS = ("max_prompts", "max_tokens", "min_token_entropy", "drop_special_tokens", "normalize", "gram_tokens",
                "gram_dtype")


@dataclass
class AnalyzeOptions:
    """Every setting of one analysis (stored in report.json as `options`).

    m: set sizes to select; batch_size: prompts per forward; max_prompts / max_tokens: truncation;
    min_token_entropy: the filter (nats, 0 disables); drop_special_tokens; normalize: "l2" rows
    (docs/method.md section 3) or "none"; gram_tokens: cap on the prompt-mode tokens per prompt
    (None: all kept tokens); max_store_bytes: bound on the prompt-mode spill file (None: none), met by
    capping gram_tokens where all kept tokens would not fit (`analysis.fitting_gram_tokens`);
    gram_dtype: precision of the spilled prompt-mode vectors; candidates:
    the layers the searches may pick (None: `layer_ids.common_candidate_layers`); beta and
    one_per_compartment: ELSI-C; novelty_half_width / novelty_threshold: compartments;
    max_exhaustive: the largest number of sets searched exhaustively; screen_z: width of the set
    searches' screen in standard errors (inf: every set evaluated on every prompt); save_every:
    batches between state saves.
    """

    m: tuple[int, ...] = (1, 3)
    batch_size: int = 8
    max_prompts: int | None = None
    max_tokens: int = 512
    min_token_entropy: float = DEFAULT_MIN_TOKEN_ENTROPY
    drop_special_tokens: bool = True
    normalize: str = "l2"
    gram_tokens: int | None = None
    max_store_bytes: int | None = None
    gram_dtype: str = "float32"
    candidates: tuple[int, ...] | None = None
    beta: float = 1.0
    one_per_compartment: bool = False
    novelty_half_width: int = 2
    novelty_threshold: float = 0.1
    max_exhaustive: int = 1000
    screen_z: float = 4.0
    save_every: int = 8

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AnalyzeOptions":
        """The options of a report.json (missing keys get today's defaults; unknown keys are ignored)."""
        known = {f.name for f in fields(cls)}
        values = {key: value for key, value in data.items() if key in known}
        for key in ("m", "candidates"):
            if values.get(key) is not None:
                values[key] = tuple(values[key])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def validate(self, num_blocks: int) -> None:
        """Check every field for an N-block model (ValueError naming the field); fills in the
        default candidates and sorts the set sizes and candidates."""
        ints = {
            "batch_size": self.batch_size,
            "max_tokens": self.max_tokens,
            "novelty_half_width": self.novelty_half_width,
            "max_exhaustive": self.max_exhaustive,
            "save_every": self.save_every,
        }
        for name, value in ints.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens: must be >= 2 (position 0 is always dropped), got {self.max_tokens}")
        if self.gram_tokens is not None and (
            isinstance(self.gram_tokens, bool) or not isinstance(self.gram_tokens, int) or self.gram_tokens < 2
        ):
            raise ValueError(f"gram_tokens: must be an integer >= 2 or None (all kept tokens), got {self.gram_tokens!r}")
        if self.max_store_bytes is not None and (
            isinstance(self.max_store_bytes, bool) or not isinstance(self.max_store_bytes, int) or self.max_store_bytes < 1
        ):
            raise ValueError(f"max_store_bytes: must be a positive integer or None (no bound), got {self.max_store_bytes!r}")
        if self.max_prompts is not None and (not isinstance(self.max_prompts, int) or self.max_prompts < 1):
            raise ValueError(f"max_prompts: must be a positive integer or None, got {self.max_prompts!r}")
        if not math.isfinite(self.min_token_entropy) or self.min_token_entropy < 0:
            raise ValueError(f"min_token_entropy: must be a finite number >= 0 (nats), got {self.min_token_entropy}")
        if self.normalize not in ("l2", "none"):
            raise ValueError(f"normalize: expected 'l2' or 'none', got {self.normalize!r}")
        if self.gram_dtype not in ("float32", "float64"):
            raise ValueError(f"gram_dtype: expected float32 or float64, got {self.gram_dtype!r}")
        if not self.screen_z >= 0:
            raise ValueError(f"screen_z: must be >= 0 (inf: evaluate every set exactly), got {self.screen_z}")
        if not math.isfinite(self.beta):
            raise ValueError(f"beta: must be a finite number, got {self.beta}")
        if self.candidates is None:
            self.candidates = tuple(common_candidate_layers(num_blocks))
        bad = [c for c in self.candidates if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= num_blocks]
        if bad or not self.candidates:
            raise ValueError(f"candidates: need layer indices in 0..{num_blocks} (N={num_blocks} blocks), got {self.candidates!r}")
        self.candidates = tuple(sorted(set(self.candidates)))
        if isinstance(self.m, int):
            self.m = (self.m,)
        if not self.m:
            raise ValueError("m: give at least one set size")
        for m in self.m:
            if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= len(self.candidates):
                raise ValueError(
                    f"m: each set size must be in 1..{len(self.candidates)}, the number of candidate layers "
                    f"{list(self.candidates)} of this N={num_blocks}-block model, got {m!r}"
                )
        self.m = tuple(sorted(set(self.m)))


DEFAULTS = AnalyzeOptions()
