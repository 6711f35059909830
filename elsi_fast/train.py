"""EAGLE3-style training of a draft head on any set of target layers, and its acceptance length.

The target runs online (no grad): each batch's hidden states at the chosen layers are captured
with the analysis hooks (`capture.capture_hidden_states`, input-to-layer ids) together with the
target's next-token logits. The draft is trained with the training-time test of EAGLE3
(`Eagle3Draft.ttt_forward`): step i feeds back the draft's own step i-1 output and predicts one
token further; its loss is the cross-entropy between the draft distribution and the target's
next-token distribution restricted to the draft vocabulary (renormalized), weighted 0.8^i.

Checkpoints: ``out_dir`` holds the draft in the EAGLE3 format (`save_pretrained`), and
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
from typing import Mapping, Sequence

import torch

from .capture import capture_hidden_states, decoder_layers
from .draft import Eagle3Config, Eagle3Draft
from .interrupt import DeferredInterrupt
from .state_files import load_state, save_state
from .training_data import token_stream

STATE_FILE = "training_state.pt"
SUMMARY_FILE = "train_summary.json"
TTT_DECAY = 0.8


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


def _check_layers(target, layers: Sequence[int]) -> list[int]:
    num_blocks = len(decoder_layers(target))
    layers = [int(layer) for layer in layers]
    if not layers:
        raise ValueError("layers: expected at least one target layer")
    if sorted(set(layers)) != layers:
        raise ValueError(f"layers: must be strictly increasing (engines concatenate in layer order), got {layers}")
    if layers[0] < 0 or layers[-1] > num_blocks:
        raise ValueError(f"layers: ids must be in 0..{num_blocks} (input-to-layer, N={num_blocks}), got {layers}")
    return layers


@torch.no_grad()
def _target_batch(target, layers: list[int], ids: torch.Tensor, draft_vocab: torch.Tensor):
    """Target features and soft labels for one batch of windows ids [B, T].

    Returns aux [B, T-1, m*d] (h_t for t = 0..T-2), next_ids [B, T-1] (x_{t+1}) and
    probs [B, T-1, Vd]: the target's distribution over x_{t+2}, restricted to the draft vocab and
    renormalized (row t comes from the target's logits at position t+1).
    """
    with capture_hidden_states(target, layers=layers) as cap:
        logits = target(input_ids=ids).logits
    aux = torch.cat([cap.states[layer] for layer in layers], dim=-1)[:, :-1].float()
    probs = torch.softmax(logits[:, 1:, draft_vocab].float(), dim=-1)
    return aux, ids[:, 1:], probs


def ttt_loss(step_logits: Sequence[torch.Tensor], probs: torch.Tensor) -> tuple[torch.Tensor, list[float], float]:
    """Weighted training-time-test loss.

    step_logits[i] [B, L, Vd] predicts token t+2+i at draft position t; its soft label is probs
    [B, L, Vd] shifted by i (row t+i); positions t >= L - i have no label and are left out.
    Returns (sum_i 0.8^i * mean cross-entropy_i, per-step losses, step-0 top-1 agreement).
    """
    total = probs.new_zeros(())
    per_step = []
    length = probs.shape[1]
    for i, logits in enumerate(step_logits):
        valid = length - i
        if valid <= 0:
            break
        logp = torch.log_softmax(logits[:, :valid].float(), dim=-1)
        ce = -(probs[:, i:] * logp).sum(-1).mean()
        total = total + TTT_DECAY**i * ce
        per_step.append(float(ce.detach()))
    agree = (step_logits[0].detach().argmax(-1) == probs.argmax(-1)).float().mean()
    return total, per_step, float(agree)


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
    texts: Sequence[str],
    *,
    out_dir: str | os.PathLike,
    draft_config: Mapping | None = None,
    draft_vocab_size: int | None = None,
    steps: int = 200,
    batch_size: int = 8,
    seq_len: int = 128,
    lr: float = 3e-3,
    warmup: int = 20,
    ttt_steps: int = 3,
    weight_decay: float = 0.0,
    seed: int = 0,
    save_every: int = 50,
    resume: bool = True,
    progress: bool = True,
) -> Eagle3Draft:
    """Train an EAGLE3 draft reading target layers `layers` (input-to-layer ids) on `texts`.

    target: a transformers causal LM (frozen, run online). texts: training documents; windows
    of `seq_len` tokens are sampled from their concatenation with a seeded generator.
    draft_config: `Eagle3Config` field overrides (default: the target's block shape).
    draft_vocab_size: size of the frequency-ranked draft vocabulary (default: min(vocab, 1024)).
    ttt_steps: training-time-test depth (EAGLE3 uses 7; 3 keeps CPU training cheap while still
    teaching the draft to consume its own outputs). The training state is saved to `out_dir`
    every `save_every` steps and on Ctrl-C (once the step under way ends, then KeyboardInterrupt
    is raised); with `resume` a rerun continues from it. Returns the trained draft in eval mode;
    the EAGLE3 checkpoint and `train_summary.json` are in `out_dir`.
    """
    for name, value, low in (("steps", steps, 1), ("batch_size", batch_size, 1), ("seq_len", seq_len, 3),
                             ("ttt_steps", ttt_steps, 1), ("save_every", save_every, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    if not lr > 0:
        raise ValueError(f"lr: expected a positive learning rate, got {lr!r}")
    layers = _check_layers(target, layers)
    vocab_size = target.config.vocab_size
    draft_vocab_size = min(vocab_size, 1024) if draft_vocab_size is None else draft_vocab_size
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / STATE_FILE
    start_time = time.perf_counter()

    stream = token_stream(tokenizer, texts)
    if stream.numel() < seq_len:
        raise ValueError(f"texts: {stream.numel()} tokens, fewer than seq_len={seq_len}")
    vocab_ids = draft_vocab_ids(stream, vocab_size, draft_vocab_size)
    config = draft_config_for(target, layers, draft_vocab_size, **dict(draft_config or {}))
    torch.manual_seed(seed)
    embed = target.get_input_embeddings().weight.detach()
    draft = Eagle3Draft(config, embed)
    draft.set_draft_vocab(vocab_ids)
    device = embed.device
    draft.to(device)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, warmup, steps))
    sampler = torch.Generator().manual_seed(seed)
    run_args = {"layers": layers, "steps": steps, "batch_size": batch_size, "seq_len": seq_len, "lr": lr,
                "warmup": warmup, "ttt_steps": ttt_steps, "weight_decay": weight_decay, "seed": seed,
                "draft_vocab_size": draft_vocab_size, "config": config.to_dict()}
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
        save_state({"args": run_args, "draft": draft.state_dict(), "optimizer": optimizer.state_dict(),
                            "schedule": schedule.state_dict(), "sampler": sampler.get_state(),
                            "step": step, "history": history}, state_path)
        draft.save_pretrained(out)

    from tqdm.auto import tqdm

    offsets = torch.arange(seq_len)
    was_training = target.training
    target.eval()
    draft.train()
    bar = tqdm(total=steps, initial=step, desc=f"train draft {layers} (threads: {torch.get_num_threads()})", disable=not progress)
    # Ctrl-C mid-step would leave the draft and its optimizer out of step: it waits for the step's
    # end, where the state is saved.
    try:
        with DeferredInterrupt("the training state") as interrupt:
            while step < steps:
                starts = torch.randint(0, stream.numel() - seq_len + 1, (batch_size,), generator=sampler)
                batch = stream[starts[:, None] + offsets].to(device)
                aux, next_ids, probs = _target_batch(target, layers, batch, vocab_ids.to(device))
                loss, per_step, agree = ttt_loss(draft.ttt_forward(aux, next_ids, ttt_steps), probs)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                schedule.step()
                step += 1
                history.append({"step": step, "loss": float(loss.detach()), "step_losses": per_step, "top1": agree})
                bar.update(1)
                bar.set_postfix(loss=f"{history[-1]['loss']:.3f}", top1=f"{agree:.2f}")
                if step % save_every == 0 or step == steps or interrupt.requested:
                    save()
                interrupt.raise_if_requested()
    finally:
        bar.close()
        target.train(was_training)
    draft.eval()
    summary = {**run_args, "seconds_this_run": time.perf_counter() - start_time,
               "final_loss": history[-1]["loss"], "history": history}
    (out / SUMMARY_FILE).write_text(json.dumps(summary))
    return draft
