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

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Mapping, Sequence

import torch

from .capture import capture_hidden_states, decoder_layers
from .draft import Eagle3Config, Eagle3Draft
from .interrupt import DeferredInterrupt
from .spec import SpecResult, draft_positions_needed, native_decoder_for, speculative_generate
from .targets import warmup_cosine

STATE_FILE = "training_state.pt"
SUMMARY_FILE = "train_summary.json"
TTT_DECAY = 0.8


def token_stream(tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """All texts tokenized back to back, each followed by EOS: int64 [n_tokens]."""
    if isinstance(texts, str) or not texts:
        raise ValueError("texts: expected a non-empty list of strings")
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for text in texts:
        if not isinstance(text, str):
            raise TypeError(f"texts: expected strings, got {type(text).__name__}")
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if eos is not None:
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


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


def _atomic_torch_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


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
        state = torch.load(state_path, weights_only=True)
        if state["args"] != run_args:
            raise ValueError(f"resume: {state_path} was written by a run with different settings; "
                             "use another out_dir or resume=False")
        draft.load_state_dict({name: tensor.to(device) for name, tensor in state["draft"].items()})
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        sampler.set_state(state["sampler"])
        step, history = state["step"], state["history"]

    def save() -> None:
        _atomic_torch_save({"args": run_args, "draft": draft.state_dict(), "optimizer": optimizer.state_dict(),
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


def speculative_runs(
    target,
    draft,
    prompts_by_category: Mapping[str, Sequence[Sequence[int] | torch.Tensor]],
    *,
    k: int = 4,
    max_new_tokens: int = 48,
    draft_dtype: str | None = None,
    draft_backend: str = "auto",
    progress: bool = False,
    state_path: str | os.PathLike | None = None,
) -> dict[str, list[SpecResult]]:
    """`speculative_generate` on every prompt: category -> one `SpecResult` per prompt.

    The draft path is chosen once (`spec.native_decoder_for`; draft_dtype / draft_backend as in
    `speculative_generate`), so int8 weights are quantized once and auto mode warns at most once.
    state_path: a JSON-lines file that gets each prompt's result as soon as it is done; a rerun
    with the same file, target, draft, prompts and settings takes the finished prompts from it
    and runs only the rest (another setting starts the file over).
    """
    from tqdm.auto import tqdm

    if not prompts_by_category:
        raise ValueError("prompts_by_category: no categories given")
    jobs = [(cat, torch.as_tensor(ids, dtype=torch.long)) for cat, prompts in prompts_by_category.items()
            for ids in prompts]
    runs: dict[str, list[SpecResult]] = {cat: [] for cat in prompts_by_category}
    log = _ResultLog(state_path, _runs_fingerprint(target, draft, jobs, k, max_new_tokens, draft_dtype, draft_backend))
    done = log.load()
    longest = max((ids.numel() for _, ids in jobs), default=1)
    decoder = None
    if len(done) < len(jobs):
        decoder = native_decoder_for(draft, draft_positions_needed(longest, max_new_tokens, k),
                                     draft_dtype=draft_dtype, draft_backend=draft_backend)
    bar = tqdm(jobs, desc=f"eval tau (threads: {torch.get_num_threads()})", disable=not progress)
    for index, (category, ids) in enumerate(bar):
        if index < len(done):
            result = done[index]
        elif decoder is not None:
            result = speculative_generate(target, decoder, ids, max_new_tokens, k)
        else:
            result = speculative_generate(target, draft, ids, max_new_tokens, k, draft_backend="torch")
        if index >= len(done):
            log.append(result)
        runs[category].append(result)
    return runs


def _runs_fingerprint(target, draft, jobs, k, max_new_tokens, draft_dtype, draft_backend) -> str:
    """What decides the results of speculative_runs: settings, prompts, the draft's weights, and the
    target's config and embeddings (hashing all of a large target's weights would take too long)."""
    digest = hashlib.sha256(json.dumps([k, max_new_tokens, draft_dtype, draft_backend,
                                        [(cat, ids.tolist()) for cat, ids in jobs]]).encode())
    digest.update(target.config.to_json_string().encode())
    tensors = [*draft.state_dict().values(), target.get_input_embeddings().weight]
    head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    if head is not None:
        tensors.append(head.weight)
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class _ResultLog:
    """Finished SpecResults of speculative_runs in a JSON-lines file: a header line with the runs'
    fingerprint, then one line per prompt in order. No file (path None): nothing is kept."""

    def __init__(self, path: str | os.PathLike | None, fingerprint: str):
        self.path = None if path is None else Path(path)
        self.fingerprint = fingerprint

    def load(self) -> list[SpecResult]:
        if self.path is None:
            return []
        results: list[SpecResult] = []
        if self.path.is_file():
            lines = self.path.read_text().splitlines()
            if lines and self._header(lines[0]) == self.fingerprint:
                for line in lines[1:]:
                    try:
                        fields = json.loads(line)
                    except json.JSONDecodeError:  # a line cut by a crash: that prompt runs again
                        break
                    results.append(SpecResult(tokens=torch.tensor(fields.pop("tokens"), dtype=torch.long), **fields))
        with open(self.path, "w") as f:  # rewritten whole: drops a cut line or another run's results
            f.write(json.dumps({"fingerprint": self.fingerprint}) + "\n")
            for result in results:
                f.write(self._line(result))
        return results

    def append(self, result: SpecResult) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(self._line(result))

    @staticmethod
    def _header(line: str) -> str | None:
        """The fingerprint a header line names (None for a line cut by a crash: start over)."""
        try:
            header = json.loads(line)
        except json.JSONDecodeError:
            return None
        return header.get("fingerprint") if isinstance(header, dict) else None

    @staticmethod
    def _line(result: SpecResult) -> str:
        fields = dataclasses.asdict(result)
        fields["tokens"] = result.tokens.tolist()
        return json.dumps(fields) + "\n"


def pooled_tau(runs: Mapping[str, Sequence[SpecResult]]) -> dict[str, float]:
    """tau per category = (accepted + rounds) / rounds summed over its prompts; "all" pools every one."""
    totals: dict[str, list[int]] = {}
    for category, results in runs.items():
        for result in results:
            for key in (category, "all"):
                emitted, rounds = totals.setdefault(key, [0, 0])
                totals[key] = [emitted + sum(result.accepted_lengths) + result.rounds, rounds + result.rounds]
    empty = [cat for cat, (_, rounds) in totals.items() if rounds == 0]
    if empty:
        raise ValueError(f"max_new_tokens: no verification round ran for {empty}; use max_new_tokens >= 2")
    pooled = totals.pop("all")
    return {**{cat: emitted / rounds for cat, (emitted, rounds) in totals.items()}, "all": pooled[0] / pooled[1]}


def evaluate_tau(
    target,
    draft,
    prompts_by_category: Mapping[str, Sequence[Sequence[int] | torch.Tensor]],
    *,
    k: int = 4,
    max_new_tokens: int = 48,
    draft_dtype: str | None = None,
    draft_backend: str = "auto",
    progress: bool = False,
    state_path: str | os.PathLike | None = None,
) -> dict[str, float]:
    """Mean acceptance length tau per category, pooled over its prompts.

    prompts_by_category: category -> list of prompt token ids. tau = (accepted + rounds) /
    rounds summed over every prompt of the category; the key ``"all"`` pools every category.
    draft_dtype / draft_backend: the draft's decode path, as in `speculative_generate`;
    state_path: as in `speculative_runs`.
    """
    return pooled_tau(speculative_runs(target, draft, prompts_by_category, k=k, max_new_tokens=max_new_tokens,
                                       draft_dtype=draft_dtype, draft_backend=draft_backend, progress=progress,
                                       state_path=state_path))
