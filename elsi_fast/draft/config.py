"""`Eagle3Config`: the shape of an EAGLE3 draft head, and its `config.json` in the EAGLE3 format.

The format is the one SpecForge writes and vLLM / SGLang read (a Llama config with
`architectures = ["LlamaForCausalLMEagle3"]`, `num_hidden_layers = 1`, `draft_vocab_size`,
`target_hidden_size`), plus the aux layer ids in both conventions of DESIGN.md section 2:
top-level `eagle_aux_hidden_state_layer_ids` is input-to-layer (vLLM, speculators) and
`eagle_config.eagle_aux_hidden_state_layer_ids` is output-of-layer, i.e. input-to-layer minus one
(SGLang, SpecForge). `from_dict` also reads speculators' layout (`transformer_layer_config`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Upstream drafts hard-code three aux layers; a config without layer ids means that default.
DEFAULT_NUM_AUX_LAYERS = 3
ARCHITECTURE = "LlamaForCausalLMEagle3"
_SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(kw_only=True)
class Eagle3Config:
    """Shape of a one-layer EAGLE3 draft head fed by `m` target hidden states.

    `aux_layer_ids` are input-to-layer ids (h_l = input of target block l, DESIGN.md section 2),
    strictly increasing because serving engines concatenate the captured states in layer order;
    `None` means the engine's EAGLE3 default of three layers. `head_dim` defaults to
    `hidden_size // num_attention_heads`, `target_hidden_size` to `hidden_size`,
    `draft_vocab_size` to `vocab_size`. `rope_scaling` is None or a Hugging Face rope dict of
    type "default" or "llama3".
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    aux_layer_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // max(self.num_attention_heads, 1)
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                     "vocab_size", "draft_vocab_size", "target_hidden_size", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Eagle3Config.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"Eagle3Config.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"Eagle3Config.head_dim must be even for rotate-half RoPE, got {self.head_dim}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"Eagle3Config.draft_vocab_size ({self.draft_vocab_size}) exceeds vocab_size ({self.vocab_size})"
            )
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ValueError(f"Eagle3Config.rms_norm_eps must be a positive finite float, got {self.rms_norm_eps!r}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"Eagle3Config.rope_theta must be a positive finite float, got {self.rope_theta!r}")
        self.rope_scaling = _check_rope_scaling(self.rope_scaling)
        if self.aux_layer_ids is not None:
            ids = tuple(self.aux_layer_ids)
            if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
                raise ValueError(f"Eagle3Config.aux_layer_ids must be non-negative ints, got {self.aux_layer_ids!r}")
            if any(b <= a for a, b in zip(ids, ids[1:])):
                raise ValueError(
                    f"Eagle3Config.aux_layer_ids must be strictly increasing (engines concatenate the captured "
                    f"states in layer order), got {list(ids)}"
                )
            self.aux_layer_ids = ids

    @property
    def num_aux_layers(self) -> int:
        """m, the number of target hidden states concatenated into `fc`."""
        return DEFAULT_NUM_AUX_LAYERS if self.aux_layer_ids is None else len(self.aux_layer_ids)

    @property
    def fc_in_features(self) -> int:
        return self.num_aux_layers * self.target_hidden_size

    def to_dict(self) -> dict[str, Any]:
        """The EAGLE3 `config.json` contents (aux layer ids in both conventions when known)."""
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
        }
        if self.aux_layer_ids is not None:
            out["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
            out["eagle_config"] = {
                "use_aux_hidden_state": True,
                "eagle_aux_hidden_state_layer_ids": [i - 1 for i in self.aux_layer_ids],
            }
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Eagle3Config":
        """Read an EAGLE3 (SpecForge / vLLM / EAGLE) or speculators `config.json` dict."""
        if not isinstance(data, dict):
            raise TypeError(f"Eagle3Config.from_dict expects a dict, got {type(data).__name__}")
        layer = data.get("transformer_layer_config", data)  # speculators nests the Llama fields
        if not isinstance(layer, dict):
            raise TypeError("config 'transformer_layer_config' must be a JSON object")
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
            if key not in layer:
                raise ValueError(f"draft config lacks required field {key!r}")
        if layer.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"EAGLE3 drafts have one decoder layer; config has num_hidden_layers="
                             f"{layer['num_hidden_layers']}")
        if layer.get("hidden_act", "silu") != "silu":
            raise ValueError(f"only the SiLU-gated MLP is supported; config has hidden_act={layer['hidden_act']!r}")
        if layer.get("attention_bias") or layer.get("mlp_bias"):
            raise ValueError("attention_bias / mlp_bias drafts are not supported (EAGLE3 linears have no bias)")
        for flag in ("norm_before_residual", "norm_before_fc", "fc_norm"):
            if data.get(flag):
                raise ValueError(f"speculators variant {flag}=true is not the EAGLE3 architecture implemented here")
        rope_theta, rope_scaling = _read_rope(layer)
        return cls(
            hidden_size=layer["hidden_size"],
            intermediate_size=layer["intermediate_size"],
            num_attention_heads=layer["num_attention_heads"],
            num_key_value_heads=layer.get("num_key_value_heads") or layer["num_attention_heads"],
            head_dim=layer.get("head_dim"),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            vocab_size=layer["vocab_size"],
            draft_vocab_size=data.get("draft_vocab_size", layer.get("draft_vocab_size")),
            target_hidden_size=data.get("target_hidden_size", layer.get("target_hidden_size")),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=layer.get("max_position_embeddings", 2048),
            aux_layer_ids=_read_layer_ids(data),
        )


def _read_layer_ids(data: dict[str, Any]) -> tuple[int, ...] | None:
    """Input-to-layer ids from either convention; both present must agree (output-of-layer = id - 1)."""
    top = data.get("eagle_aux_hidden_state_layer_ids")
    eagle_config = data.get("eagle_config") or {}
    nested = eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_config, dict) else None
    from_nested = None if nested is None else tuple(int(i) + 1 for i in nested)
    if top is not None and from_nested is not None and tuple(top) != from_nested:
        raise ValueError(
            f"config layer ids disagree: eagle_aux_hidden_state_layer_ids={list(top)} (input-to-layer) but "
            f"eagle_config.eagle_aux_hidden_state_layer_ids={list(nested)} (output-of-layer) means {list(from_nested)}"
        )
    if top is not None:
        return tuple(top)
    return from_nested


def _read_rope(layer: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from a transformers 4.x (`rope_theta`, `rope_scaling`) or 5.x
    (`rope_parameters`) style config; an absent theta means 10000."""
    params = layer.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", layer.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") == "default":
            scaling = None
        return float(theta), scaling
    return float(layer.get("rope_theta", 10000.0)), layer.get("rope_scaling")


def _check_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise TypeError(f"Eagle3Config.rope_scaling must be a dict or None, got {type(scaling).__name__}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(f"Eagle3Config.rope_scaling type {rope_type!r} is not supported "
                         f"(supported: {', '.join(_SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        return None
    missing = [k for k in _LLAMA3_ROPE_KEYS if k not in scaling]
    if missing:
        raise ValueError(f"Eagle3Config.rope_scaling of type 'llama3' lacks {missing}")
    return {"rope_type": "llama3", **{k: scaling[k] for k in _LLAMA3_ROPE_KEYS}}
