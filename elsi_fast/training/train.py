"""EAGLE3-style training of a draft head on any set of target layers, and its acceptance length.

The target runs online (no grad): each batch's hidden states at the chosen layers are captured
with the analysis hooks (`capture.capture_hidden_states`, input-to-layer ids) together with the
target's next-token logits. The draft is trained with the training-time test of EAGLE3
(`Eagle3Draft.ttt_forward`): step i feeds back the draft's own step i-1 output and predicts one
token further; its loss is the cross-entropy between the draft distribution and the target's
next-token distribution restricted to the draft vocabulary (renormalized), weighted 0.8^i. On
conversations of the target's own greedy answers the labels can instead be the answers' next
tokens (`labels="answers"`): what greedy verification accepts, with no target state past the
draft's deepest layer (docs/real-models.md, "Labels from the answers").

Checkpoints: ``out_dir`` holds the draft in the EAGLE3 format (`draft.formats.write_draft`), and
``out_dir/training_state.pt`` the draft weights, optimizer, schedule, data-sampler state and step,
written atomically, so an interrupted run resumes where it stopped and ends with the same weights
as an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, NamedTuple, Sequence

import torch

from .._infra.interrupt import DeferredInterrupt
from .._infra.native_names import TRAINING_PRECISIONS
from .._infra.state_files import load_state, save_state
from ..analysis.pass_state import rank_and_world
from ..draft import Eagle3Config, Eagle3Draft
from ..draft.formats import write_draft
from ..engines.layer_ids import check_layer_set
from ..targets.capture import capture_hidden_states, decoder_layers, plain_lm_head
from .feature_cache import samples_fingerprint
from .head_loss import head_cross_entropy
from .training_data import Sample, pad_samples, token_stream

if TYPE_CHECKING:
    from .feature_cache import FeatureCache

STATE_FILE = "training_state.pt"
SUMMARY_FILE = "train_summary.json"
TTT_DECAY = 0.8
# Conversations of a batch are run in length-sorted groups of this many, each padded to its own
# longest: on the 800 SmolLM2 training conversations a random batch of 16 padded as one is 70% real
# tokens, in groups of 4 it is 91%, with the same loss and gradient (the groups' gradients add up).
MICRO_BATCH = 4
CHECKPOINTS_DIR = "checkpoints"


class TrainedDraft(NamedTuple):
    """What `train_draft` returns: the trained draft and the summary of the run, the dict
    `train_summary.json` holds (the settings, draft-vocabulary coverage, precision, seconds and
    training tokens/s of this run, final loss, and the per-step history of loss, top-1 and tokens)."""

    draft: Eagle3Draft
    summary: dict


def training_precision(precision: str, device: torch.device) -> str:
    """What `precision` means on `device`: "auto" is bf16 autocast on a GPU with bf16 and on a CPU
    that multiplies bf16 natively (AVX512-BF16, AMX), where a step runs about 1.7x faster
    (bench/bench_train.py), and fp32 elsewhere (AVX2: bf16 there is emulated). Under bf16 the
    master weights, the optimizer, norms, softmax and the loss stay fp32 (torch.autocast)."""
    if precision not in TRAINING_PRECISIONS:
        raise ValueError(f"precision: expected one of {', '.join(TRAINING_PRECISIONS)}, got {precision!r}")
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    from .._infra._backends import native_bf16_cpu

    return "bfloat16" if device.type == "cpu" and native_bf16_cpu() else "float32"


def draft_vocab_ids(token_ids: torch.Tensor, vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """Target ids of the draft vocabulary: the `draft_vocab_size` most frequent ids in `token_ids`.

    Sorted ascending, as `Eagle3Draft.set_draft_vocab` needs (draft id i -> target id
    ids[i] = i + d2t[i]). Ties in frequency go to the smaller id; ids never seen fill the
    remainder in id order.
    """
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size: must be in 1..{vocab_size} (the target vocab), got {draft_vocab_size}")
    if token_ids.numel() and (token_ids.min() < 0 or token_ids.max() >= vocab_size):
        raise ValueError(f"token_ids: ids must be in 0..{vocab_size - 1}")
    counts = torch.bincount(token_ids.flatten(), minlength=vocab_size)
    # A stable sort on -count keeps id order among equal counts.
    order = torch.sort(-counts, stable=True).indices
    return torch.sort(order[:draft_vocab_size]).values


def grown_draft_vocab_ids(kept: torch.Tensor, token_ids: torch.Tensor, vocab_size: int,
                          draft_vocab_size: int) -> torch.Tensor:
    """`kept` (a draft's vocabulary, ascending target ids) grown to `draft_vocab_size` ids with the
    most frequent ids of `token_ids` it lacks (ties to the smaller id, then unseen ids in id order),
    sorted ascending: a continued draft keeps every token it can draft today."""
    if not kept.numel() <= draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size: must be in {kept.numel()}..{vocab_size} (the kept draft's vocabulary "
                         f"to the target's), got {draft_vocab_size}")
    counts = torch.bincount(token_ids.flatten(), minlength=vocab_size).to(torch.float64)
    counts[kept] = float("inf")  # first in the order, whatever their count now
    order = torch.sort(-counts, stable=True).indices
    return torch.sort(order[:draft_vocab_size]).values


def draft_vocab_size_for_coverage(token_ids: torch.Tensor, vocab_size: int, coverage: float,
                                  kept: torch.Tensor | None = None) -> int:
    """The fewest draft tokens that cover the share `coverage` of `token_ids` (the tokens the draft
    learns to predict): the most frequent ones, as `draft_vocab_ids` picks them, or after `kept` (a
    continued draft's vocabulary, which stays whole, as `grown_draft_vocab_ids` keeps it). A token
    outside the draft vocabulary can never be drafted, so this sizes the head from the data
    (docs/method.md section 6)."""
    if not 0.0 < coverage <= 1.0:
        raise ValueError(f"draft_vocab_coverage: expected a share in (0, 1], got {coverage!r}")
    if not token_ids.numel():
        raise ValueError("draft_vocab_coverage: the data has no tokens to cover")
    counts = torch.bincount(token_ids.flatten(), minlength=vocab_size).to(torch.float64)
    base, start = 0.0, 0
    if kept is not None:
        base, start = float(counts[kept].sum()), kept.numel()
        counts[kept] = 0.0
    covered = base + torch.cumsum(torch.sort(counts, descending=True).values, 0)
    # The first size whose covered count reaches the goal (counts are integers: no rounding doubt).
    goal = coverage * token_ids.numel()
    extra = 0 if base >= goal else int(torch.searchsorted(covered, torch.tensor([goal], dtype=torch.float64))) + 1
    return max(1, min(vocab_size, start + extra))


def draft_config_for(target, layers: Sequence[int], draft_vocab_size: int, **overrides) -> Eagle3Config:
    """An `Eagle3Config` shaped like the target's own blocks (EAGLE3's choice), reading `layers`.

    `overrides` are `Eagle3Config` fields (intermediate_size, heads, ...); hidden_size is the
    target's, since the draft shares the target's token embedding.
    """
    tc = target.config
    fields = dict(
        hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
        head_dim=getattr(tc, "head_dim", None), rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        vocab_size=tc.vocab_size, draft_vocab_size=draft_vocab_size,
        target_hidden_size=tc.hidden_size,
        rope_theta=getattr(tc, "rope_theta", None) or (getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 10000.0),
        max_position_embeddings=getattr(tc, "max_position_embeddings", 2048),
        aux_layer_ids=tuple(int(layer) for layer in layers),
    )
    if overrides.get("hidden_size", tc.hidden_size) != tc.hidden_size:
        raise ValueError(
            f"draft_config: hidden_size must equal the target's ({tc.hidden_size}): the draft "
            "concatenates the target's token embedding with its own hidden state"
        )
    if "num_attention_heads" in overrides and "head_dim" not in overrides:
        fields["head_dim"] = None  # re-derived from hidden_size and the new head count
    fields.update(overrides)
    return Eagle3Config(**fields)


class _WindowBatches:
    """Raw text: windows of `seq_len` tokens of the token stream, every draft row in the loss."""

    def __init__(self, stream: torch.Tensor, seq_len: int):
        if stream.numel() < seq_len:
            raise ValueError(f"texts: {stream.numel()} tokens, fewer than seq_len={seq_len}")
        self.stream, self.offsets = stream, torch.arange(seq_len)

    def draw(self, batch_size: int, sampler: torch.Generator) -> torch.Tensor:
        return torch.randint(0, self.stream.numel() - len(self.offsets) + 1, (batch_size,), generator=sampler)

    def micro_batches(self, picked: torch.Tensor) -> list[torch.Tensor]:
        return [picked]  # windows are all seq_len long: nothing to save

    @torch.no_grad()
    def features(self, target, layers, picked: torch.Tensor, draft_vocab: torch.Tensor, device):
        ids = self.stream[picked[:, None] + self.offsets].to(device)
        with capture_hidden_states(target, layers=layers) as cap:
            logits = target(input_ids=ids).logits
        aux = torch.cat([cap.states[layer] for layer in layers], dim=-1)[:, :-1].float()
        rows = torch.ones(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool, device=ids.device)
        return aux, ids[:, 1:], logits[:, 1:, draft_vocab].float().flatten(0, 1), rows, ids.numel()


class _SampleBatches:
    """Conversations: whole samples, right-padded; a draft row is in the loss when the token it
    predicts is part of the answer. Features from the target online, or from a `FeatureCache`.
    labels "target": the target's logits over the draft vocabulary; "answers": the answer's own
    next token as a draft-vocabulary index [n] (rows whose token the draft vocabulary lacks, which
    no draft could propose, leave the loss), and the target runs only up to the deepest layer."""

    def __init__(self, samples: Sequence[Sample], cache: "FeatureCache | None", head_weight: torch.Tensor | None,
                 labels: str):
        self.samples, self.cache, self.head_weight, self.labels = samples, cache, head_weight, labels

    def draw(self, batch_size: int, sampler: torch.Generator) -> torch.Tensor:
        return torch.randint(0, len(self.samples), (batch_size,), generator=sampler)

    def micro_batches(self, picked: torch.Tensor) -> list[torch.Tensor]:
        """`picked` in groups of MICRO_BATCH samples of similar length (less padding)."""
        lengths = torch.tensor([len(self.samples[i].ids) for i in picked.tolist()])
        ordered = picked[torch.argsort(lengths, stable=True)]
        return list(ordered.split(MICRO_BATCH))

    @torch.no_grad()
    def features(self, target, layers, picked: torch.Tensor, draft_vocab: torch.Tensor, device):
        answers = self.labels == "answers"
        if self.cache is not None:
            ids, attention, loss_mask, aux, final = self.cache.batch(self.samples, picked.tolist(), layers)
        else:
            ids, attention, loss_mask = pad_samples([self.samples[i] for i in picked.tolist()])
            with capture_hidden_states(target, layers=layers, stop=answers) as cap:
                out = target(input_ids=ids.to(device), attention_mask=attention.to(device))
            aux = torch.cat([cap.states[layer] for layer in layers], dim=-1)
        if answers:
            loss_mask = loss_mask & torch.isin(ids, draft_vocab.cpu())
        rows = _label_rows(loss_mask).to(device)
        aux, ids = aux[:, :-1].float().to(device), ids.to(device)
        if answers:
            index = torch.full((int(max(ids.max(), draft_vocab.max())) + 1,), -1, dtype=torch.long, device=device)
            index[draft_vocab] = torch.arange(len(draft_vocab), device=device)
            labels = index[ids[:, 2:]][rows[:, :-1]]  # row t predicts x_{t+2}; the last row has none
        elif self.cache is not None:
            labels = torch.nn.functional.linear(final[:, 1:].to(device)[rows], self.head_weight[draft_vocab].float())
        else:
            labels = out.logits[:, 1:][rows][:, draft_vocab].float()
        return aux, ids[:, 1:], labels, rows, int(attention.sum())


def _label_rows(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, T-1] draft rows in the loss: row t (features h_t, token x_{t+1}) is trained on the
    target's prediction of x_{t+2}, so it is in when x_{t+2} is an answer token."""
    rows = torch.zeros(loss_mask.shape[0], loss_mask.shape[1] - 1, dtype=torch.bool)
    rows[:, :-1] = loss_mask[:, 2:]
    return rows


def ttt_loss(step_logits: Sequence[torch.Tensor], probs: torch.Tensor, positions: torch.Tensor,
             counts: Sequence[float] | None = None) -> tuple[torch.Tensor, list[float], list[float]]:
    """Weighted training-time-test loss over the rows in the loss, packed.

    probs [n, Vd]: the soft labels of the n label rows (b, s) (``label_rows.nonzero()`` order);
    positions [n]: their s. step_logits[i] [n_i, Vd] (`Eagle3Draft.ttt_forward(...,
    label_rows=...)`): step i's logits at (b, s - i) for the rows with s >= i, labelled by those
    rows' probs (step i at position t predicts token t + 2 + i, the label of row t + i).
    counts[i]: the number of rows step i averages over (default: this batch's; under
    torch.distributed, every rank's). Returns (sum_i 0.8^i * mean cross-entropy_i, per-step
    cross-entropy sums, [step-0 top-1 agreements, rows]) as plain numbers for logging.
    """
    total = probs.new_zeros(())
    sums: list[float] = []
    for i, logits in enumerate(step_logits):
        labels = probs[positions >= i]
        ce = -(labels * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
        count = float(labels.shape[0]) if counts is None else counts[i]
        total = total + TTT_DECAY**i * ce.sum() / max(count, 1.0)
        sums.append(float(ce.detach().sum()))
    agree = (step_logits[0].detach().argmax(-1) == probs.argmax(-1)).float().sum()
    return total, sums, [float(agree), float(probs.shape[0])]


def ttt_head_loss(step_inputs: Sequence[torch.Tensor], head_weight: torch.Tensor, labels: torch.Tensor,
                  positions: torch.Tensor, counts: Sequence[float] | None = None,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, list[float], list[float]]:
    """`ttt_loss` for one-hot labels, with the head applied here, fused with the loss
    (`head_loss.head_cross_entropy`, its product in `dtype`): labels [n] the draft-vocabulary
    indices of the label rows (labels from the answers), step_inputs[i] [n_i, d] the head's inputs
    (`Eagle3Draft.ttt_forward(..., head=False)`), head_weight [Vd, d]. The same loss and gradients
    to float rounding, without the [n, Vd] logits and one-hot labels (docs/performance.md)."""
    step_labels = [labels[positions >= i] for i in range(len(step_inputs))]
    sizes = [len(step) for step in step_labels]
    counts = [float(size) for size in sizes] if counts is None else counts
    scale = torch.cat([torch.full((size,), TTT_DECAY**i / max(counts[i], 1.0)) for i, size in enumerate(sizes)])
    total, ce, top = head_cross_entropy(torch.cat(list(step_inputs)), head_weight, torch.cat(step_labels),
                                        scale.to(labels.device), dtype, argmax_rows=sizes[0])
    sums = [float(part.sum()) for part in ce.split(sizes)]
    agree = float((top == step_labels[0]).sum())
    return total, sums, [agree, float(labels.shape[0])]


def _row_counts(positions: torch.Tensor, steps: int) -> list[float]:
    """Rows of each training-time-test step: the label rows at positions >= i, for i < steps."""
    return [float((positions >= i).sum()) for i in range(steps)]


def _all_reduce_sum(values: list[float], world: int) -> list[float]:
    if world == 1:
        return values
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor.tolist()


def _average_gradients(params: list[torch.nn.Parameter], world: int) -> None:
    """Sum the ranks' gradients: each rank's loss is already divided by the global row counts, so
    the sum is the gradient of the single-process loss on the whole global batch."""
    if world == 1:
        return
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _read_continued(path: "str | os.PathLike", embed: torch.Tensor) -> Eagle3Draft:
    """The draft at `path` in fp32, or one line saying it is none."""
    from ..draft.formats import read_draft

    try:
        return read_draft(path, embed, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"init_from: {path} is not a readable draft folder ({error})") from None


def _check_continued(start: Eagle3Draft, path: "str | os.PathLike", config: Eagle3Config) -> None:
    """Refuse `start` unless it has this run's layers and shape (its draft vocabulary may be
    smaller, and its key-value heads fewer when they divide this run's: `_grown_state` widens both)."""
    if list(start.config.aux_layer_ids) != list(config.aux_layer_ids):
        raise ValueError(f"init_from: {path} reads layers {list(start.config.aux_layer_ids)}, "
                         f"this run {list(config.aux_layer_ids)}")
    theirs, ours = start.config.to_dict(), config.to_dict()
    if theirs["draft_vocab_size"] < ours["draft_vocab_size"]:
        theirs["draft_vocab_size"] = ours["draft_vocab_size"]
    if ours["num_key_value_heads"] % theirs["num_key_value_heads"] == 0:
        theirs["num_key_value_heads"] = ours["num_key_value_heads"]
    differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
    if differ:
        raise ValueError(f"init_from: {path} differs from this run's draft in {', '.join(differ)} "
                         f"({', '.join(f'{k}={theirs.get(k)!r} vs {ours.get(k)!r}' for k in differ[:3])})")


def _grown_state(start: Eagle3Draft, draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    """`start`'s weights for `draft`, whose draft vocabulary holds `start`'s and maybe more: a kept
    token keeps its head row; a new one starts at a zero row (logit 0, below what a trained head
    gives the tokens it drafts), so the continued draft first drafts what `start` drafted.

    When `draft` has r times `start`'s key-value heads, each of `start`'s is copied to the r that
    serve its query heads now (query head h reads key-value head h // (heads / kv heads)), so the
    continued draft computes what `start` computed, and its query groups can then learn apart
    (docs/real-models.md, "Copying": Gemma 3's one key-value head did not learn to copy)."""
    state = {k: v for k, v in start.state_dict().items() if k not in ("d2t", "t2d", "lm_head.weight")}
    widen = draft.config.num_key_value_heads // start.config.num_key_value_heads
    if widen > 1:
        head_dim = start.midlayer.self_attn.head_dim
        for name in ("midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight"):
            rows = state[name].unflatten(0, (-1, head_dim))  # [kv heads, head_dim, in]
            state[name] = rows.repeat_interleave(widen, dim=0).flatten(0, 1)
    n = start.config.draft_vocab_size
    old_ids = start.draft_to_target(torch.arange(n))
    new_ids = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size))
    head = start.lm_head.weight.new_zeros(draft.lm_head.weight.shape)
    head[torch.searchsorted(new_ids, old_ids)] = start.lm_head.weight.detach()
    return {**state, "lm_head.weight": head, "d2t": draft.d2t, "t2d": draft.t2d}


def init_from_target(draft: Eagle3Draft, target) -> None:
    """Warm start: the draft's layer from the target's last block where shapes allow and the block
    computes what the draft's Llama layer does, its final norm and head rows from the target's. fc
    maps the m target states to their mean (identity blocks / m), so the first step sees the states
    themselves; q/k/v read the hidden half of the 2d concat with the target's weights and start at
    zero on the embedding half."""
    block = decoder_layers(target)[-1]
    attention_transfers, mlp_transfers, norms_transfer = _llama_parts(block, target)
    weights = {name: w for name, w in block.named_parameters()
               if (name.startswith("self_attn.") and attention_transfers) or (name.startswith("mlp.") and mlp_transfers)}
    own = draft.midlayer
    d = draft.config.hidden_size
    with torch.no_grad():
        m = draft.config.num_aux_layers
        if draft.config.target_hidden_size == d:
            draft.fc.weight.copy_(torch.cat([torch.eye(d)] * m, dim=1) / m)
        for name in ("q_proj", "k_proj", "v_proj"):
            source = weights.get(f"self_attn.{name}.weight")
            target_weight = getattr(own.self_attn, name).weight
            if source is not None and source.shape == (target_weight.shape[0], d):
                target_weight.zero_()
                target_weight[:, d:] = source
        pairs = {"self_attn.o_proj.weight": own.self_attn.o_proj.weight, "mlp.gate_proj.weight": own.mlp.gate_proj.weight,
                 "mlp.up_proj.weight": own.mlp.up_proj.weight, "mlp.down_proj.weight": own.mlp.down_proj.weight}
        for name, parameter in pairs.items():
            if name in weights and weights[name].shape == parameter.shape:
                parameter.copy_(weights[name])
        norms = {draft.norm: getattr(target.base_model, "norm", None)}
        if norms_transfer:  # the block's norms sit where the draft's do
            norms.update({own.post_attention_layernorm: getattr(block, "post_attention_layernorm", None),
                          own.input_layernorm: getattr(block, "input_layernorm", None),
                          own.hidden_norm: getattr(block, "input_layernorm", None)})
        for mine, theirs in norms.items():
            if isinstance(getattr(theirs, "weight", None), torch.Tensor) and theirs.weight.shape == mine.weight.shape:
                # Gemma's RMSNorm scales by (1 + weight), the draft's (as Llama's) by weight.
                mine.weight.copy_(theirs.weight + (1.0 if type(theirs).__name__.startswith("Gemma") else 0.0))
        head = target.get_output_embeddings()
        ids = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size, device=draft.d2t.device))
        if head is not None and head.weight.shape[1] == d:
            draft.lm_head.weight.copy_(head.weight[ids.to(head.weight.device)])


def _llama_parts(block, target) -> tuple[bool, bool, bool]:
    """Whether the target block's attention, MLP and norms compute what the draft's Llama layer's
    do, so their weights are a warm start. Not where the block normalizes q and k (Qwen3, Gemma 3), wraps
    attention and MLP in extra norms (Gemma's sandwich: copied, their outputs would enter the
    residual unnormalized, at the scale of Gemma's stream) or activates with other than SiLU.
    Copying Gemma 3's block diverged (docs/method.md, section 6, warm start)."""
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    activation = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    sandwich = hasattr(block, "pre_feedforward_layernorm") or hasattr(block, "post_feedforward_layernorm")
    attention = getattr(block, "self_attn", None)
    qk_norm = attention is not None and (hasattr(attention, "q_norm") or hasattr(attention, "k_norm"))
    return not (sandwich or qk_norm), not sandwich and activation == "silu", not sandwich


def warmup_cosine(step: int, warmup: int, steps: int) -> float:
    """Learning-rate factor: linear warm-up over `warmup` steps, then cosine decay to 10%."""
    if step < warmup:
        return (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * frac))


def train_draft(
    target,
    tokenizer,
    layers: Sequence[int],
    data: Sequence[str] | Sequence[Sample],
    *,
    out_dir: str | os.PathLike,
    draft_config: Mapping | None = None,
    draft_vocab_size: int | None = None,
    draft_vocab_coverage: float | None = None,
    steps: int = 200,
    batch_size: int = 8,
    seq_len: int = 128,
    lr: float = 3e-3,
    warmup: int = 20,
    ttt_steps: int = 3,
    weight_decay: float = 0.0,
    label_temperature: float = 1.0,
    labels: str = "target",
    seed: int = 0,
    init: str = "random",
    init_from: "str | os.PathLike | None" = None,
    feature_cache: "FeatureCache | None" = None,
    save_every: int = 50,
    keep_steps: Sequence[int] = (),
    precision: str = "auto",
    resume: bool = True,
    progress: bool = True,
) -> TrainedDraft:
    """Train an EAGLE3 draft reading target layers `layers` (input-to-layer ids) on `data`.

    target: a transformers causal LM (frozen). data: raw texts (windows of `seq_len` tokens of their
    concatenation, every position in the loss) or conversation `Sample`s (`training_data`: the
    target's own answers, whole samples, the loss on the answer tokens only). feature_cache: a
    `feature_cache.FeatureCache` dumped from these samples: the target then never runs (offline
    training). draft_config: `Eagle3Config` field overrides (default: the target's block shape).
    draft_vocab_size: the most frequent tokens of the data (answer tokens of conversations; default
    min(vocab, 1024), or the continued draft's). draft_vocab_coverage: instead of a size, the share of
    those tokens the vocabulary must cover (`draft_vocab_size_for_coverage`). ttt_steps: training-time-test depth (EAGLE3 uses
    7). label_temperature: the soft labels are the target's softmax over the draft vocabulary at
    this temperature (1: its own distribution; below 1 sharper, towards its greedy token, which
    is all that greedy verification accepts; docs/real-models.md). labels: "target" (its
    distribution, as above) or "answers": conversation samples only, each row labelled one-hot by
    the answer's next token, which for the target's own greedy answers is its greedy token (up to
    the engine that wrote them; docs/real-models.md); the target runs only up to the draft's
    deepest layer, or a cache dumped with `final=False` serves. init: "random" or "target" (`init_from_target`). init_from: a draft folder to continue from (more data, or a second
    schedule for a kept draft): its weights and draft vocabulary, with a fresh optimizer and
    schedule; its layers and shape must be this run's. A larger `draft_vocab_size` grows its
    vocabulary with the data's most frequent tokens it lacks (`grown_draft_vocab_ids`), whose head
    rows start at zero. batch_size is the global batch: under torch.distributed each rank
    takes its share of every step's batch and the gradients are summed, which gives the weights of
    one process on the same batches (to float tolerance). The training state is saved to `out_dir`
    every `save_every` steps and on Ctrl-C (once the step under way ends, then KeyboardInterrupt is
    raised); with `resume` a rerun continues from it. keep_steps: steps whose draft is also kept,
    in `out_dir/checkpoints/step-NNNNNN/` (EAGLE3 folders: a curve of tau against tokens seen).
    precision: "auto", "float32" or "bfloat16" (`training_precision`); it is not part of the
    settings a resume checks, so a run moved to another machine continues at that machine's.
    Returns a `TrainedDraft`: the trained draft in eval mode and the run's summary; the EAGLE3
    checkpoint and the same summary (`train_summary.json`, for resumed runs and other tools) are in
    `out_dir` (written by rank 0).
    """
    for name, value, low in (("steps", steps, 1), ("batch_size", batch_size, 1), ("seq_len", seq_len, 3),
                             ("ttt_steps", ttt_steps, 1), ("save_every", save_every, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    if not lr > 0:
        raise ValueError(f"lr: expected a positive learning rate, got {lr!r}")
    if isinstance(label_temperature, bool) or not isinstance(label_temperature, (int, float)) or \
            not 0 < label_temperature < float("inf"):
        raise ValueError(f"label_temperature: expected a finite number > 0, got {label_temperature!r}")
    if labels not in ("target", "answers"):
        raise ValueError(f"labels: expected 'target' or 'answers', got {labels!r}")
    if labels == "answers" and label_temperature != 1.0:
        raise ValueError("label_temperature: labels from the answers are one-hot; a temperature applies to the "
                         "target's labels only")
    if init not in ("random", "target"):
        raise ValueError(f"init: expected 'random' or 'target', got {init!r}")
    rank, world = rank_and_world()
    if batch_size % world:
        raise ValueError(f"batch_size: the global batch of {batch_size} does not split over {world} processes")
    if any(isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= steps for k in keep_steps):
        raise ValueError(f"keep_steps: expected steps in 1..{steps}, got {list(keep_steps)}")
    layers = check_layer_set(layers, len(decoder_layers(target)))
    vocab_size = target.config.vocab_size
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / STATE_FILE
    start_time = time.perf_counter()

    source, predicted, data_kind = _batches(target, tokenizer, data, seq_len, feature_cache, labels)
    embed = target.get_input_embeddings().weight.detach()
    start = None if init_from is None else _read_continued(init_from, embed)
    kept = None if start is None else start.draft_to_target(torch.arange(start.config.draft_vocab_size))
    if draft_vocab_coverage is not None:
        if draft_vocab_size is not None:
            raise ValueError("draft_vocab_coverage: give a size or a coverage, not both")
        draft_vocab_size = draft_vocab_size_for_coverage(predicted, vocab_size, draft_vocab_coverage, kept)
    if draft_vocab_size is None:
        draft_vocab_size = min(vocab_size, 1024) if start is None else start.config.draft_vocab_size
    config = draft_config_for(target, layers, draft_vocab_size, **dict(draft_config or {}))
    if start is not None:
        _check_continued(start, init_from, config)
    if kept is None:
        vocab_ids = draft_vocab_ids(predicted, vocab_size, draft_vocab_size)
    else:
        vocab_ids = grown_draft_vocab_ids(kept, predicted, vocab_size, draft_vocab_size)
    # A token outside the draft vocabulary can never be drafted: the share inside caps acceptance.
    coverage = float(torch.isin(predicted, vocab_ids).float().mean()) if predicted.numel() else 1.0
    torch.manual_seed(seed)
    draft = Eagle3Draft(config, embed)
    draft.set_draft_vocab(vocab_ids)
    if start is not None:
        draft.load_state_dict(_grown_state(start, draft))
    elif init == "target":
        init_from_target(draft, target)
    device = embed.device
    requested_precision, precision = precision, training_precision(precision, device)
    draft.to(device)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, warmup, steps))
    sampler = torch.Generator().manual_seed(seed)
    run_args = {"layers": layers, "steps": steps, "batch_size": batch_size, "seq_len": seq_len, "lr": lr,
                "warmup": warmup, "ttt_steps": ttt_steps, "weight_decay": weight_decay, "seed": seed,
                "draft_vocab_size": draft_vocab_size, "init": init, "data": data_kind, "config": config.to_dict()}
    if init_from is not None:
        run_args["init_from"] = str(Path(init_from).resolve())
    if label_temperature != 1.0:  # absent at 1, so the states of earlier runs still resume
        run_args["label_temperature"] = float(label_temperature)
    if labels != "target":
        run_args["labels"] = labels
    step, history = 0, []
    if resume and state_path.is_file():
        state = load_state(state_path, "resume")
        if state["args"] != run_args:
            raise ValueError(f"resume: {state_path} was written by a run with different settings; "
                             "use another out_dir or resume=False")
        draft.load_state_dict({name: tensor.to(device) for name, tensor in state["draft"].items()})
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        sampler.set_state(state["sampler"])
        step, history = state["step"], state["history"]

    def save() -> None:
        if rank == 0:
            save_state({"args": run_args, "draft": draft.state_dict(), "optimizer": optimizer.state_dict(),
                        "schedule": schedule.state_dict(), "sampler": sampler.get_state(),
                        "step": step, "history": history}, state_path)
            write_draft(draft, out)
            if step in keep_steps:
                write_draft(draft, out / CHECKPOINTS_DIR / f"step-{step:06d}")

    from tqdm.auto import tqdm

    was_training = target.training
    target.eval()
    draft.train()
    local = batch_size // world
    tokens_seen, step_seconds = 0, 0.0
    bar = tqdm(total=steps, initial=step, desc=f"train draft {layers} ({precision}, threads: {torch.get_num_threads()})",
               disable=not progress or rank != 0)
    # Ctrl-C mid-step would leave the draft and its optimizer out of step: it waits for the step's
    # end, where the state is saved.
    try:
        with DeferredInterrupt("the training state") as interrupt:
            while step < steps:
                began = time.perf_counter()
                picked = source.draw(batch_size, sampler)[rank * local : (rank + 1) * local]
                groups = [source.features(target, layers, group, vocab_ids.to(device), device)
                          for group in source.micro_batches(picked)]
                positions = [rows.nonzero(as_tuple=True)[1] for _, _, _, rows, _ in groups]
                counts = _all_reduce_sum([sum(c) for c in zip(*(_row_counts(p, ttt_steps) for p in positions))], world)
                optimizer.zero_grad(set_to_none=True)
                sums, agree, tokens = [0.0] * ttt_steps, [0.0, 0.0], 0
                for (aux, next_ids, row_labels, rows, group_tokens), group_positions in zip(groups, positions):
                    one_hot = row_labels.dtype == torch.long  # labels from the answers: indices
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bfloat16"):
                        step_out = draft.ttt_forward(aux, next_ids, ttt_steps, label_rows=rows, head=not one_hot)
                    if one_hot:
                        loss, group_sums, group_agree = ttt_head_loss(
                            step_out, draft.lm_head.weight, row_labels, group_positions, counts,
                            torch.bfloat16 if precision == "bfloat16" else torch.float32)
                    else:
                        probs = torch.softmax(row_labels / label_temperature, dim=-1)  # the target's, sharpened
                        loss, group_sums, group_agree = ttt_loss(step_out, probs, group_positions, counts)
                    loss.backward()  # each group's loss is over the global row counts: the gradients add up
                    sums = [a + b for a, b in zip(sums, group_sums)]
                    agree = [a + b for a, b in zip(agree, group_agree)]
                    tokens += group_tokens
                _average_gradients(params, world)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                schedule.step()
                step += 1
                totals = _all_reduce_sum([*sums, *agree, float(tokens)], world)
                per_step = [s / max(c, 1.0) for s, c in zip(totals[: len(sums)], counts)]
                top1 = totals[len(sums)] / max(totals[len(sums) + 1], 1.0)
                weighted = sum(TTT_DECAY**i * ce for i, ce in enumerate(per_step))
                history.append({"step": step, "loss": weighted, "step_losses": per_step, "top1": top1,
                                "tokens": int(totals[-1])})
                tokens_seen += int(totals[-1])
                step_seconds += time.perf_counter() - began
                bar.update(1)
                bar.set_postfix(loss=f"{weighted:.3f}", top1=f"{top1:.2f}", tok_s=f"{tokens_seen / step_seconds:.0f}")
                if step % save_every == 0 or step == steps or step in keep_steps or interrupt.requested:
                    save()
                interrupt.raise_if_requested()
    finally:
        bar.close()
        target.train(was_training)
    draft.eval()
    summary = {**run_args, "draft_vocab_coverage": coverage, "precision": requested_precision,
               "precision_this_run": precision, "seconds_this_run": time.perf_counter() - start_time,
               "tokens_per_second_this_run": tokens_seen / step_seconds if step_seconds else None,
               "final_loss": history[-1]["loss"], "history": history}
    if rank == 0:
        (out / SUMMARY_FILE).write_text(json.dumps(summary))
    return TrainedDraft(draft, summary)


def _batches(target, tokenizer, data, seq_len: int, feature_cache, labels: str):
    """(batch source, the tokens the draft learns to predict (for its vocabulary), data kind)."""
    if isinstance(data, str) or not data:
        raise ValueError("data: expected a non-empty list of texts or conversation samples")
    if all(isinstance(item, Sample) for item in data):
        head = None
        if feature_cache is not None:
            if feature_cache.meta["samples"] != samples_fingerprint(data):
                raise ValueError(f"feature_cache: {feature_cache.path} was dumped from other samples")
            if not feature_cache.complete:
                raise ValueError(f"feature_cache: {feature_cache.path} is not complete; finish dumping it first")
            if labels == "target":
                if not feature_cache.has_final:
                    raise ValueError(f"feature_cache: {feature_cache.path} holds no final states, which the target's "
                                     "labels come from; train with labels='answers' or dump a cache with them")
                head = plain_lm_head(target).weight.detach()
        predicted = torch.cat([s.ids[s.loss_mask] for s in data])
        return _SampleBatches(data, feature_cache, head, labels), predicted, "conversations"
    if labels != "target":
        raise ValueError("labels: 'answers' needs conversation samples (the target's own answers); raw texts are "
                         "labelled by the target")
    if feature_cache is not None:
        raise ValueError("feature_cache: only conversation samples are dumped; raw texts train online")
    stream = token_stream(tokenizer, data)
    return _WindowBatches(stream, seq_len), stream, "texts"
