"""train_draft: soft labels, TTT loss, vocab mapping, learning, resume, checkpoints."""

from __future__ import annotations

import collections
import json
import os
import signal

import pytest
import torch

from elsi_fast import train as train_mod
from elsi_fast.draft import Eagle3Draft
from elsi_fast.train import draft_vocab_ids, train_draft, ttt_loss
from elsi_fast.training_data import token_stream
from tiny_lm import SMALL, TARGET, TEXTS, TOKENIZER


def test_draft_vocab_ids_are_the_most_frequent_sorted():
    tokens = torch.tensor([5, 5, 5, 2, 2, 9, 9, 9, 9, 7, 1, 1])
    # counts: 9:4, 5:3, 2:2, 1:2, 7:1 -> top 4 = {9, 5, 1, 2} (1 before 2 only by id among equals)
    assert draft_vocab_ids(tokens, 12, 4).tolist() == [1, 2, 5, 9]
    # 1 and 2 tie at two occurrences: the smaller id wins the last slot
    assert draft_vocab_ids(tokens, 12, 3).tolist() == [1, 5, 9]


def test_draft_vocab_ids_tie_break_and_fill():
    tokens = torch.tensor([4, 4, 6, 6, 3])
    assert draft_vocab_ids(tokens, 8, 2).tolist() == [4, 6]
    assert draft_vocab_ids(tokens, 8, 3).tolist() == [3, 4, 6]
    assert draft_vocab_ids(tokens, 8, 5).tolist() == [0, 1, 3, 4, 6]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        draft_vocab_ids(tokens, 8, 9)


def test_target_batch_soft_labels_align_with_target_logits():
    ids = token_stream(TOKENIZER, TEXTS)[:20].reshape(2, 10)
    vocab_ids = torch.tensor([0, 3, 7, 11, 40, 100])
    aux, next_ids, probs = train_mod._target_batch(TARGET, [1, 4], ids, vocab_ids)
    with torch.no_grad():
        out = TARGET(input_ids=ids, output_hidden_states=True)
    assert aux.shape == (2, 9, 64) and next_ids.shape == (2, 9) and probs.shape == (2, 9, 6)
    torch.testing.assert_close(aux[..., :32], out.hidden_states[1][:, :9])
    assert torch.equal(next_ids, ids[:, 1:])
    logits = out.logits.double()[:, :, vocab_ids]
    # row t is the target's distribution over x_{t+2}, i.e. its logits at position t+1
    expected = torch.softmax(logits[:, 1:], dim=-1)
    torch.testing.assert_close(probs.double(), expected, rtol=1e-5, atol=1e-6)


def test_ttt_loss_matches_float64_reference():
    torch.manual_seed(0)
    b, length, vd, steps = 2, 7, 5, 3
    step_logits = [torch.randn(b, length, vd) for _ in range(steps)]
    probs = torch.softmax(torch.randn(b, length, vd), dim=-1)
    total, per_step, agree = ttt_loss(step_logits, probs)
    expected_total, expected_steps = 0.0, []
    for i, logits in enumerate(step_logits):
        ce = []
        for bb in range(b):
            for t in range(length - i):  # step i at position t is labelled by row t + i
                p = probs[bb, t + i].double()
                ce.append(float(-(p * torch.log_softmax(logits[bb, t].double(), -1)).sum()))
        expected_steps.append(sum(ce) / len(ce))
        expected_total += 0.8**i * expected_steps[-1]
    assert per_step == pytest.approx(expected_steps, rel=1e-5)
    assert float(total) == pytest.approx(expected_total, rel=1e-5)
    assert agree == pytest.approx(float((step_logits[0].argmax(-1) == probs.argmax(-1)).float().mean()))


def test_training_reduces_loss_and_writes_an_eagle3_checkpoint(tmp_path):
    draft = train_draft(TARGET, TOKENIZER, [1, 3], TEXTS, out_dir=tmp_path, steps=40, seed=0,
                        **{**SMALL, "lr": 1e-2})
    history = json.loads((tmp_path / "train_summary.json").read_text())["history"]
    assert len(history) == 40
    first = sum(h["loss"] for h in history[:5]) / 5
    last = sum(h["loss"] for h in history[-5:]) / 5
    assert last < 0.8 * first
    assert sum(h["top1"] for h in history[-5:]) / 5 > sum(h["top1"] for h in history[:5]) / 5 + 0.2

    # the draft vocabulary is the 96 most frequent training tokens, mapped by d2t / t2d
    counts = collections.Counter(token_stream(TOKENIZER, TEXTS).tolist())
    ranked = sorted(range(len(TOKENIZER)), key=lambda i: (-counts.get(i, 0), i))[:96]
    mapped = (torch.arange(96) + draft.d2t).tolist()
    assert mapped == sorted(ranked)
    assert draft.t2d.nonzero().flatten().tolist() == sorted(ranked)

    reloaded = Eagle3Draft.from_pretrained(tmp_path, embed_tokens=TARGET.get_input_embeddings().weight.detach())
    assert reloaded.config.aux_layer_ids == (1, 3)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3]
    for name, tensor in draft.state_dict().items():
        assert torch.equal(tensor, reloaded.state_dict()[name]), name


@pytest.mark.parametrize("stop", ["crash", "ctrl_c"])
def test_resume_after_interruption_equals_uninterrupted_run(tmp_path, monkeypatch, stop):
    """A crash in the fifth step loses it (the state has the step-4 checkpoint); Ctrl-C in the
    fifth step lets it finish and saves it although no checkpoint was due."""
    args = dict(steps=6, seed=1, save_every=2 if stop == "crash" else 100, **SMALL)
    full = train_draft(TARGET, TOKENIZER, [2], TEXTS, out_dir=tmp_path / "full", **args)

    real_batch = train_mod._target_batch
    calls = {"n": 0}

    def stop_in_fifth(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 5:
            if stop == "crash":
                raise KeyboardInterrupt  # raised by the code itself: nothing can save the step
            os.kill(os.getpid(), signal.SIGINT)
        return real_batch(*a, **kw)

    monkeypatch.setattr(train_mod, "_target_batch", stop_in_fifth)
    with pytest.raises(KeyboardInterrupt):
        train_draft(TARGET, TOKENIZER, [2], TEXTS, out_dir=tmp_path / "split", **args)
    monkeypatch.setattr(train_mod, "_target_batch", real_batch)
    assert calls["n"] == 5
    state = torch.load(tmp_path / "split" / train_mod.STATE_FILE, weights_only=True)
    assert state["step"] == (4 if stop == "crash" else 5)
    resumed = train_draft(TARGET, TOKENIZER, [2], TEXTS, out_dir=tmp_path / "split", **args)
    history = json.loads((tmp_path / "split" / "train_summary.json").read_text())["history"]
    assert [h["step"] for h in history] == list(range(1, 7))
    for name, tensor in full.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), name

    with pytest.raises(ValueError, match="different settings"):
        train_draft(TARGET, TOKENIZER, [2], TEXTS, out_dir=tmp_path / "split", **{**args, "lr": 1e-3})


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="layers"):
        train_draft(TARGET, TOKENIZER, [3, 1], TEXTS, out_dir=tmp_path, steps=1, **SMALL)
    with pytest.raises(ValueError, match="layers"):
        train_draft(TARGET, TOKENIZER, [5], TEXTS, out_dir=tmp_path, steps=1, **SMALL)
    with pytest.raises(ValueError, match="steps"):
        train_draft(TARGET, TOKENIZER, [1], TEXTS, out_dir=tmp_path, steps=0, **SMALL)
    with pytest.raises(ValueError, match="hidden_size"):
        train_draft(TARGET, TOKENIZER, [1], TEXTS, out_dir=tmp_path, steps=1,
                    **{**SMALL, "draft_config": {"hidden_size": 16}})
    with pytest.raises(ValueError, match="texts"):
        train_draft(TARGET, TOKENIZER, [1], "just a string", out_dir=tmp_path, steps=1, **SMALL)
