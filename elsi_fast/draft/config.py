"""`Eagle3Config`: the shape and architecture variant of an EAGLE3 draft head, and its `config.json`.

The config.json of the two folder formats (`elsi_fast.draft.formats`), told apart on read by
`speculators_model_type`:

* "eagle3": the config SpecForge writes and vLLM / SGLang read (a Llama config with
  `architectures = ["LlamaForCausalLMEagle3"]`, `num_hidden_layers = 1`, `draft_vocab_size`,
  `target_hidden_size`). elsi-fast adds the aux layer ids in both conventions of docs/method.md
  section 2 and their count, so that every engine's fallback reads the same m and layers:
  top-level `eagle_aux_hidden_state_layer_ids` (input-to-layer: the capture ids of vLLM),
  `num_aux_hidden_states` (the fc width of vLLM and SGLang), and `eagle_config` =
  {`use_aux_hidden_state`, `eagle_aux_hidden_state_layer_ids` (output-of-layer, id - 1: SGLang's
  and SpecForge's capture ids)}. `eagle_config` never carries `layer_ids`, the key vLLM falls
  back to for capture ids. Which engine reads which field is listed in `elsi_fast.engines.layer_ids`.
* "speculators": the config `speculators.SpeculatorModel.from_pretrained` and vLLM's speculators
  path load (`speculators_model_type = "eagle3"`, the layer fields nested in
  `transformer_layer_config`, the verifier named in `speculators_config`).

Architecture switches that change the math (docs/method.md section 5 is the plain layer):
`norm_before_residual` (the residual of the attention block is hidden_norm(h), not h),
`norm_before_fc` (one RMSNorm over the m-state concatenation before fc), `fc_norm` (one RMSNorm
per aux state before fc), `norm_feedback` (the next step is fed norm(h''), speculators' and
vLLM's / SGLang's `norm_output=true`), `final_norm=False` (logits = lm_head(h''), SpecForge's
`norm_output=false`), `qk_norm` (per-head RMSNorm on q and k before RoPE: a Qwen3 layer) and
`sliding_window` (attend to the last `sliding_window` positions only). A config field that
changes the math in a way not implemented here is refused with an error naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..engines.layer_ids import from_output_of_layer, to_output_of_layer

# Upstream drafts hard-code three aux layers; a config without layer ids means that default.
DEFAULT_NUM_AUX_LAYERS = 3
ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
# speculators' `transformer_layer_config.model_type` -> whether the layer has q/k norms.
_SPECULATORS_LAYER_TYPES = {"llama": False, "qwen3": True}
# Variant switches, in the order `native_unsupported_reason` lists them.
_VARIANT_FIELDS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_feedback", "final_norm", "qk_norm",
                   "sliding_window")
_SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(kw_only=True)
class Eagle3Config:
    """Shape of a one-layer EAGLE3 draft head fed by `m` target hidden states.

    `aux_layer_ids` are input-to-layer ids (h_l = input of target block l, docs/method.md section 2),
    strictly increasing because serving engines concatenate the captured states in layer order;
    `None` means the engine's EAGLE3 default of three layers. `head_dim` defaults to
    `hidden_size // num_attention_heads`, `target_hidden_size` to `hidden_size`,
    `draft_vocab_size` to `vocab_size`. `rope_scaling` is None or a Hugging Face rope dict of
    type "default" or "llama3". The variant switches are described in the module docstring; all
    defaults give the plain EAGLE3 layer.
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
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_feedback: bool = False
    final_norm: bool = True
    qk_norm: bool = False
    sliding_window: int | None = None

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
        for name in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_feedback", "final_norm", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Eagle3Config.{name} must be a bool, got {getattr(self, name)!r}")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("Eagle3Config.norm_before_fc and fc_norm are exclusive (one norm over the concatenation, "
                             "or one per aux state)")
        if self.sliding_window is not None and (
                isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int)
                or self.sliding_window < 1):
            raise ValueError(f"Eagle3Config.sliding_window must be a positive int or None, got {self.sliding_window!r}")

    @property
    def variants(self) -> dict[str, Any]:
        """The architecture switches that differ from the plain EAGLE3 layer, by field name."""
        plain = Eagle3Config.__dataclass_fields__
        return {name: getattr(self, name) for name in _VARIANT_FIELDS if getattr(self, name) != plain[name].default}

    def native_unsupported_reason(self) -> str | None:
        """Why the fused native decode op cannot run this draft (it implements the plain layer), or None."""
        variants = self.variants
        if not variants:
            return None
        listed = ", ".join(f"{k}={v}" for k, v in variants.items())
        return f"variant {listed}: the native op implements the plain EAGLE3 layer"

    @property
    def num_aux_layers(self) -> int:
        """m, the number of target hidden states concatenated into `fc`."""
        return DEFAULT_NUM_AUX_LAYERS if self.aux_layer_ids is None else len(self.aux_layer_ids)

    @property
    def fc_in_features(self) -> int:
        return self.num_aux_layers * self.target_hidden_size

    def _layer_fields(self) -> dict[str, Any]:
        """The Llama fields of the decoder layer, shared by both formats."""
        out: dict[str, Any] = {
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
        }
        if self.sliding_window is not None:
            out["layer_types"] = ["sliding_attention"]
            out["sliding_window"] = self.sliding_window
        return out

    def to_dict(self) -> dict[str, Any]:
        """The "eagle3" `config.json` contents (see the module docstring; `to_speculators_dict` for
        the other format). Raises ValueError for a variant that this format cannot state so that
        every engine reading it computes the same draft.
        """
        unstated = [name for name in ("norm_feedback", "final_norm", "qk_norm") if name in self.variants]
        if unstated:
            raise ValueError(
                f"format='eagle3' cannot state the variant {unstated}: the eagle3 field `norm_output` means "
                f"'feed the normed state back' to vLLM 0.32 / SGLang 0.5.23 and 'apply the final norm' to SpecForge "
                f"0.2, and its architecture has no q/k norms; save with format='speculators' (norm_feedback, "
                f"qk_norm) or serve a final_norm=False draft with SpecForge's own loader"
            )
        out: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": "llama", **self._layer_fields(),
                               "draft_vocab_size": self.draft_vocab_size,
                               "target_hidden_size": self.target_hidden_size,
                               "num_aux_hidden_states": self.num_aux_layers}
        for name in ("norm_before_residual", "norm_before_fc", "fc_norm"):
            if getattr(self, name):
                out[name] = True
        if self.aux_layer_ids is not None:
            out["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
            out["eagle_config"] = {"use_aux_hidden_state": True}
            # h_0 has no output-of-layer id: such a draft carries the input-to-layer ids only (the
            # output-of-layer engines cannot capture it anyway).
            if 0 not in self.aux_layer_ids:
                out["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = to_output_of_layer(self.aux_layer_ids)
        return out

    def to_speculators_dict(self, verifier: dict[str, Any], speculative_tokens: int = 3) -> dict[str, Any]:
        """speculators 0.9's `Eagle3SpeculatorConfig` as a dict.

        verifier: {"name_or_path": hub id, local directory or None, "architectures": [...]} of the
        target (speculators reads the target's layer count and, when a checkpoint lacks them, its
        embedding and lm_head from there). Every switch is written explicitly: vLLM 0.32 reads a
        missing `norm_before_residual` of a speculators config as true.
        """
        if self.target_hidden_size != self.hidden_size:
            raise ValueError(
                f"format='speculators' needs target_hidden_size == hidden_size (speculators 0.9 sizes fc as "
                f"m * hidden_size), got target_hidden_size={self.target_hidden_size}, hidden_size={self.hidden_size}"
            )
        if not self.final_norm:
            raise ValueError("format='speculators' cannot state final_norm=False (speculators always applies the "
                             "final norm before lm_head)")
        if self.aux_layer_ids is None:
            raise ValueError("format='speculators' needs the aux layer ids (Eagle3Config.aux_layer_ids): speculators "
                             "would otherwise substitute its default [2, N//2, N-3]")
        if isinstance(speculative_tokens, bool) or not isinstance(speculative_tokens, int) or speculative_tokens < 1:
            raise ValueError(f"speculative_tokens must be a positive int, got {speculative_tokens!r}")
        # vLLM 0.32 builds its draft config from transformer_layer_config plus the switches, and sizes
        # fc from num_aux_hidden_states there (else 3): without it an m != 3 draft does not load.
        layer = {"model_type": "qwen3" if self.qk_norm else "llama", **self._layer_fields(),
                 "num_aux_hidden_states": self.num_aux_layers}
        return {
            "architectures": [SPECULATORS_ARCHITECTURE],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "norm_before_residual": self.norm_before_residual,
            "norm_before_fc": self.norm_before_fc,
            "fc_norm": self.fc_norm,
            "norm_output": self.norm_feedback,
            "embed_requires_grad": False,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier.get("name_or_path"),
                             "architectures": list(verifier.get("architectures") or [])},
            },
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], norm_output_meaning: str | None = None) -> "Eagle3Config":
        """Read an "eagle3" (SpecForge / vLLM / SGLang / EAGLE) or "speculators" `config.json` dict.

        `norm_output` in an eagle3 config means "feed the normed state back" to vLLM and SGLang
        and "apply the final norm before lm_head" to SpecForge; such a config is refused unless
        `norm_output_meaning` says whose meaning it has ("vllm", "sglang" or "specforge").
        """
        if not isinstance(data, dict):
            raise TypeError(f"Eagle3Config.from_dict expects a dict, got {type(data).__name__}")
        speculators = "speculators_model_type" in data
        if speculators:
            if data["speculators_model_type"] != "eagle3":
                raise ValueError(f"speculators_model_type={data['speculators_model_type']!r} is not an EAGLE3 draft")
            layer = data.get("transformer_layer_config")
            if not isinstance(layer, dict):
                raise ValueError("speculators config: 'transformer_layer_config' must be a JSON object")
            model_type = layer.get("model_type", "llama")
            if model_type not in _SPECULATORS_LAYER_TYPES:
                raise ValueError(f"transformer_layer_config.model_type={model_type!r} is not supported "
                                 f"(supported: {', '.join(_SPECULATORS_LAYER_TYPES)})")
            layer = _complete_layer_config(model_type, layer)
            variants = {"norm_before_residual": bool(data.get("norm_before_residual", False)),
                        "norm_before_fc": bool(data.get("norm_before_fc", False)),
                        "fc_norm": bool(data.get("fc_norm", False)),
                        "norm_feedback": bool(data.get("norm_output", False)),
                        "qk_norm": _SPECULATORS_LAYER_TYPES[model_type]}
        else:
            layer = data
            if data.get("model_type", "llama") != "llama" or any(
                    a != ARCHITECTURE and "Llama" not in a for a in data.get("architectures") or []):
                raise ValueError(f"eagle3 config: only Llama-layer drafts are supported, got model_type="
                                 f"{data.get('model_type')!r}, architectures={data.get('architectures')!r}")
            eagle_config = data.get("eagle_config") or {}
            if eagle_config.get("use_aux_hidden_state", True) is False:
                raise ValueError("eagle_config.use_aux_hidden_state=false (a draft fed the last hidden state without "
                                 "fc) is not supported")
            variants = {"norm_before_residual": bool(data.get("norm_before_residual", False)),
                        "norm_before_fc": bool(eagle_config.get("norm_before_fc", data.get("norm_before_fc", False))),
                        "fc_norm": bool(data.get("fc_norm", False) or data.get("use_aux_norm", False))}
            if "norm_output" in data:
                variants.update(_read_eagle3_norm_output(bool(data["norm_output"]), norm_output_meaning))
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
            if key not in layer:
                raise ValueError(f"draft config lacks required field {key!r}")
        _refuse_unimplemented(layer)
        for holder in (data, layer):
            if "num_aux_hidden_states" in holder:
                _check_num_aux(data, holder["num_aux_hidden_states"])
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
            sliding_window=_read_sliding_window(layer),
            **variants,
        )


def _complete_layer_config(model_type: str, layer: dict[str, Any]) -> dict[str, Any]:
    """speculators saves `transformer_layer_config` as a diff against its model type's defaults
    (a Qwen3 layer without `head_dim` has head_dim 128); fill them in as speculators and vLLM do."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(model_type, **{k: v for k, v in layer.items() if k != "model_type"})
    except Exception as err:  # transformers validates with its own exception types
        raise ValueError(f"speculators transformer_layer_config is not a valid {model_type} config: {err}") from err
    return config.to_dict()


_NORM_OUTPUT_MEANINGS = {"vllm": "feedback", "sglang": "feedback", "specforge": "final_norm"}


def _read_eagle3_norm_output(value: bool, meaning: str | None) -> dict[str, bool]:
    if meaning is None:
        raise ValueError(
            f"eagle3 config field norm_output={str(value).lower()} has two meanings: vLLM 0.32 and SGLang 0.5.23 feed "
            f"the normed state back to the next draft step, SpecForge 0.2 applies (true) or skips (false) the final "
            f"norm before lm_head; pass norm_output_meaning='vllm', 'sglang' or 'specforge' (whose checkpoint it is)"
        )
    if meaning not in _NORM_OUTPUT_MEANINGS:
        raise ValueError(f"norm_output_meaning must be one of {sorted(_NORM_OUTPUT_MEANINGS)}, got {meaning!r}")
    if _NORM_OUTPUT_MEANINGS[meaning] == "feedback":
        return {"norm_feedback": value}
    return {"final_norm": value}


# Fields of a draft's layer config that change the math, with the values the plain layer has.
_PLAIN_LAYER = {
    "hidden_act": ("silu",),
    "attention_bias": (False, None),
    "mlp_bias": (False, None),
    "qkv_bias": (False, None),
    "bias": (False, None),
    "logit_scale": (1.0, 1, None),
    "partial_rotary_factor": (1.0, 1, None),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "attention_chunk_size": (None,),
    "num_hidden_layers": (1, None),
}


def _refuse_unimplemented(layer: dict[str, Any]) -> None:
    """Raise for any field whose value changes the draft's math in a way not implemented here
    (transformers 5 keeps some of them inside `rope_parameters`)."""
    rope = layer.get("rope_parameters")
    fields = {**(rope if isinstance(rope, dict) else {}), **layer}
    for name, plain in _PLAIN_LAYER.items():
        if name in fields and fields[name] not in plain:
            raise ValueError(f"draft config field {name}={fields[name]!r} is not supported (the implemented layer has "
                             f"{name}={plain[0]!r}); loading it would compute a different draft")


def _check_num_aux(data: dict[str, Any], m: Any) -> None:
    ids = _read_layer_ids(data)
    if ids is not None and m != len(ids):
        raise ValueError(f"config num_aux_hidden_states={m} disagrees with the {len(ids)} aux layer ids {list(ids)}")


def _read_sliding_window(layer: dict[str, Any]) -> int | None:
    """The window of a one-layer draft: `layer_types[0] == "sliding_attention"` (speculators and vLLM
    read only `layer_types`); a `use_sliding_window` flag without `layer_types` is ambiguous."""
    layer_types = layer.get("layer_types")
    if layer_types is None:
        if layer.get("use_sliding_window"):
            raise ValueError("draft config sets use_sliding_window=true without layer_types; engines differ on which "
                             "layers slide, so state layer_types explicitly")
        return None
    if not isinstance(layer_types, list) or len(layer_types) != 1 or layer_types[0] not in (
            "full_attention", "sliding_attention"):
        raise ValueError(f"draft config layer_types must be ['full_attention'] or ['sliding_attention'] for a one-layer "
                         f"draft, got {layer_types!r}")
    if layer_types[0] == "full_attention":
        return None
    window = layer.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"draft config layer_types=['sliding_attention'] needs a positive sliding_window, got {window!r}")
    return window


def _read_layer_ids(data: dict[str, Any]) -> tuple[int, ...] | None:
    """Input-to-layer ids from either convention; both present must agree (output-of-layer = id - 1)."""
    top = data.get("eagle_aux_hidden_state_layer_ids")
    eagle_config = data.get("eagle_config") or {}
    nested = eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_config, dict) else None
    from_nested = None if nested is None else tuple(from_output_of_layer(nested))
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
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
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
