"""train_draft: soft labels, TTT loss, vocab mapping, learning, resume, checkpoints."""

from __future__ import annotations

import collections
import json

import pytest
import torch

from elsi_fast.draft import Eagle3Draft
from elsi_fast.training import train as train_mod
from elsi_fast.training.train import (draft_vocab_ids, draft_vocab_size_for_coverage, grown_draft_vocab_ids, train_draft,
                                      ttt_loss)
from elsi_fast.training.training_data import token_stream
from tiny_lm import SMALL, TARGET, TEXTS, TOKENIZER, conversation_samples_of_tiny_target


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


def test_draft_vocab_size_for_coverage_is_the_fewest_tokens_that_cover_the_share():
    tokens = torch.tensor([5] * 5 + [2] * 3 + [9] * 2)  # counts 5, 3, 2 of 10
    sizes = {share: draft_vocab_size_for_coverage(tokens, 12, share) for share in (0.1, 0.5, 0.51, 0.8, 0.81, 1.0)}
    assert sizes == {0.1: 1, 0.5: 1, 0.51: 2, 0.8: 2, 0.81: 3, 1.0: 3}
    for share, size in sizes.items():  # the same vocabulary draft_vocab_ids picks reaches the share
        assert torch.isin(tokens, draft_vocab_ids(tokens, 12, size)).double().mean() >= share
    # After a kept vocabulary ({9}: 0.2 of the tokens), the most frequent of the others join it.
    kept = torch.tensor([9])
    assert [draft_vocab_size_for_coverage(tokens, 12, s, kept) for s in (0.2, 0.21, 0.7, 0.71)] == [1, 2, 2, 3]
    for bad in (0.0, 1.01, float("nan")):
        with pytest.raises(ValueError, match="draft_vocab_coverage"):
            draft_vocab_size_for_coverage(tokens, 12, bad)


def test_target_batch_label_logits_align_with_target_logits():
    stream = token_stream(TOKENIZER, TEXTS)[:20]
    ids = stream.reshape(2, 10)
    vocab_ids = torch.tensor([0, 3, 7, 11, 40, 100])
    windows = train_mod._WindowBatches(stream, 10)
    aux, next_ids, label_logits, rows, tokens = windows.features(TARGET, [1, 4], torch.tensor([0, 10]), vocab_ids,
                                                                 "cpu")
    assert rows.shape == (2, 9) and rows.all() and tokens == 20  # raw text: every row in the loss
    with torch.no_grad():
        out = TARGET(input_ids=ids, output_hidden_states=True)
    assert aux.shape == (2, 9, 64) and next_ids.shape == (2, 9) and label_logits.shape == (18, 6)
    torch.testing.assert_close(aux[..., :32], out.hidden_states[1][:, :9])
    assert torch.equal(next_ids, ids[:, 1:])
    # row t is labelled by the target's logits over x_{t+2}, i.e. its logits at position t+1
    expected = out.logits.double()[:, 1:][:, :, vocab_ids]
    torch.testing.assert_close(label_logits.reshape(2, 9, 6).double(), expected, rtol=1e-5, atol=1e-5)


def _packed(step_logits: list[torch.Tensor], probs: torch.Tensor, rows: torch.Tensor):
    """ttt_loss's packed inputs from full [B, L, Vd] tensors: step i's logits at (b, s - i) for the
    label rows (b, s) with s >= i, the labels at the rows, and the rows' positions s."""
    b_idx, s_idx = rows.nonzero(as_tuple=True)
    packed = [logits[b_idx[s_idx >= i], s_idx[s_idx >= i] - i] for i, logits in enumerate(step_logits)]
    return packed, probs[rows], s_idx


def test_ttt_loss_matches_float64_reference():
    torch.manual_seed(0)
    b, length, vd, steps = 2, 7, 5, 3
    step_logits = [torch.randn(b, length, vd) for _ in range(steps)]
    probs = torch.softmax(torch.randn(b, length, vd), dim=-1)
    total, sums, (agree, rows) = ttt_loss(*_packed(step_logits, probs, torch.ones(b, length, dtype=torch.bool)))
    per_step = [s / (b * (length - i)) for i, s in enumerate(sums)]
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
    assert agree / rows == pytest.approx(float((step_logits[0].argmax(-1) == probs.argmax(-1)).float().mean()))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_fused_head_loss_is_the_one_hot_loss_of_the_heads_logits(dtype, tol):
    """Labels from the answers: ttt_head_loss (the head fused with the loss) gives ttt_loss's value, step
    sums, top-1 count and gradients on the head's logits with one-hot labels, the head's product in
    `dtype` as autocast runs it (bf16: to bf16 rounding)."""
    torch.manual_seed(2)
    n, d, vd, steps = 300, 24, 37, 3  # more rows than one chunk of head_loss
    labels = torch.randint(0, vd, (n,))
    positions = torch.randint(0, 6, (n,))
    counts = [float((positions >= i).sum()) + 3 for i in range(steps)]  # other ranks' rows too
    inputs = [torch.randn(int((positions >= i).sum()), d, requires_grad=True) for i in range(steps)]
    weight = torch.nn.Parameter(torch.randn(vd, d) / d**0.5)
    fused = train_mod.ttt_head_loss(inputs, weight, labels, positions, counts, dtype)
    fused[0].backward()
    fused_grads = [x.grad.clone() for x in inputs] + [weight.grad.clone()]
    for p in inputs + [weight]:
        p.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        logits = [torch.nn.functional.linear(x, weight) for x in inputs]
    one_hot = torch.nn.functional.one_hot(labels, vd).float()
    plain = ttt_loss(logits, one_hot, positions, counts)
    plain[0].backward()
    assert float(fused[0].detach()) == pytest.approx(float(plain[0].detach()), rel=tol)
    assert fused[1] == pytest.approx(plain[1], rel=tol)
    # top-1 counts: the two products may round a near tie apart, more so in bf16
    assert fused[2][1] == plain[2][1] and abs(fused[2][0] - plain[2][0]) <= (1 if dtype == torch.float32 else 3)
    for got, want in zip(fused_grads, [x.grad for x in inputs] + [weight.grad]):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))


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
    for bad in (0.0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="label_temperature: expected a finite number > 0"):
            train_draft(TARGET, TOKENIZER, [1], TEXTS, out_dir=tmp_path, steps=1, label_temperature=bad, **SMALL)


def test_label_temperature_sharpens_the_labels_and_is_part_of_a_runs_settings(samples, tmp_path, monkeypatch):
    seen = []
    real_loss = train_mod.ttt_loss
    monkeypatch.setattr(train_mod, "ttt_loss", lambda logits, probs, *a: (seen.append(probs), real_loss(logits, probs, *a))[1])
    args = {**CONVERSATION_ARGS, "steps": 2, "save_every": 1}
    _, plain = train_draft(TARGET, TOKENIZER, [2], samples, out_dir=tmp_path / "t1", **args)
    soft, seen[:] = seen[0].double(), []
    _, sharp = train_draft(TARGET, TOKENIZER, [2], samples, out_dir=tmp_path / "t025", label_temperature=0.25, **args)
    # the same rows' labels: softmax(z / 0.25) is p^4 renormalized, p = softmax(z)
    expected = soft**4 / (soft**4).sum(-1, keepdim=True)
    torch.testing.assert_close(seen[0].double(), expected, rtol=1e-4, atol=1e-6)
    assert "label_temperature" not in plain and sharp["label_temperature"] == 0.25
    with pytest.raises(ValueError, match="resume: .* different settings"):
        train_draft(TARGET, TOKENIZER, [2], samples, out_dir=tmp_path / "t025", label_temperature=0.5, **args)


def test_masked_ttt_loss_matches_float64_reference():
    torch.manual_seed(1)
    b, length, vd, steps = 2, 6, 4, 3
    step_logits = [torch.randn(b, length, vd) for _ in range(steps)]
    probs = torch.softmax(torch.randn(b, length, vd), dim=-1)
    rows = torch.rand(b, length) > 0.4
    total, sums, (agree, count) = ttt_loss(*_packed(step_logits, probs, rows))
    expected_total = 0.0
    for i, logits in enumerate(step_logits):
        ce = [float(-(probs[bb, t + i].double() * torch.log_softmax(logits[bb, t].double(), -1)).sum())
              for bb in range(b) for t in range(length - i) if rows[bb, t + i]]
        assert sums[i] == pytest.approx(sum(ce), rel=1e-5)
        expected_total += 0.8**i * sum(ce) / len(ce)
    assert float(total) == pytest.approx(expected_total, rel=1e-5)
    assert count == float(rows.sum())


CONVERSATION_ARGS = dict(SMALL, batch_size=4, steps=8, seed=3, lr=5e-3)


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    return conversation_samples_of_tiny_target(tmp_path_factory.mktemp("conversations"))


def test_conversations_train_on_answer_tokens_only(samples, tmp_path):
    draft, summary = train_draft(TARGET, TOKENIZER, [2, 4], samples, out_dir=tmp_path,
                                 **{**CONVERSATION_ARGS, "steps": 30})
    # the returned summary is the one train_summary.json keeps for later readers
    assert json.loads((tmp_path / "train_summary.json").read_text()) == json.loads(json.dumps(summary))
    history = summary["history"]
    assert history[-1]["loss"] < history[0]["loss"]
    answers = torch.cat([s.ids[s.loss_mask] for s in samples])
    expected = draft_vocab_ids(answers, TARGET.config.vocab_size, CONVERSATION_ARGS["draft_vocab_size"])
    assert torch.equal(draft.draft_to_target(torch.arange(len(expected))), expected)
    assert summary["draft_vocab_coverage"] == pytest.approx(float(torch.isin(answers, expected).float().mean()))
    small, small_summary = train_draft(TARGET, TOKENIZER, [2, 4], samples, out_dir=tmp_path / "small",
                                       **{**CONVERSATION_ARGS, "steps": 1, "draft_vocab_size": 8})
    covered = torch.isin(answers, small.draft_to_target(torch.arange(8))).float().mean()
    assert 0 < float(covered) < 1
    assert small_summary["draft_vocab_coverage"] == pytest.approx(float(covered))
    # Sized by coverage: the fewest most frequent answer tokens that reach the share.
    args = {k: v for k, v in CONVERSATION_ARGS.items() if k != "draft_vocab_size"}
    _, sized = train_draft(TARGET, TOKENIZER, [2, 4], samples, out_dir=tmp_path / "sized",
                           **{**args, "steps": 1, "draft_vocab_coverage": 0.9})
    size = sized["draft_vocab_size"]
    assert sized["draft_vocab_coverage"] >= 0.9 > float(
        torch.isin(answers, draft_vocab_ids(answers, TARGET.config.vocab_size, size - 1)).float().mean())
    assert all(h["tokens"] > 0 for h in history)
    # a batch's rows are exactly those whose predicted token lies in an answer
    source = train_mod._SampleBatches(samples, None, None, "target")
    _, _, _, mask, _ = source.features(TARGET, [2, 4], torch.tensor([0, 1]), expected, "cpu")
    for b, sample in enumerate(samples[:2]):
        n = len(sample.ids)
        assert mask[b, : n - 2].tolist() == sample.loss_mask[2:].tolist() and not mask[b, n - 2 :].any()


def test_offline_training_from_the_feature_cache_equals_online_training(samples, tmp_path):
    from elsi_fast.training.feature_cache import build

    online = train_draft(TARGET, TOKENIZER, [1, 3], samples, out_dir=tmp_path / "online", **CONVERSATION_ARGS)
    cache = build(TARGET, samples, [1, 2, 3], tmp_path / "cache", batch_size=3, progress=False)
    offline = train_draft(TARGET, TOKENIZER, [1, 3], samples, out_dir=tmp_path / "offline", feature_cache=cache,
                          **CONVERSATION_ARGS)
    curves = [run.summary["history"] for run in (online, offline)]
    online, offline = online.draft, offline.draft
    assert [h["loss"] for h in curves[1]] == pytest.approx([h["loss"] for h in curves[0]], rel=1e-4)
    for name, tensor in online.state_dict().items():
        torch.testing.assert_close(offline.state_dict()[name], tensor, rtol=1e-3, atol=1e-4)
    with pytest.raises(ValueError, match=r"feature_cache: .* holds layers \[1, 2, 3\], not \[4\]"):
        train_draft(TARGET, TOKENIZER, [4], samples, out_dir=tmp_path / "bad", feature_cache=cache, **CONVERSATION_ARGS)
    with pytest.raises(ValueError, match="feature_cache: .* other samples"):
        train_draft(TARGET, TOKENIZER, [1], samples[:-1], out_dir=tmp_path / "bad2", feature_cache=cache,
                    **CONVERSATION_ARGS)


def _ddp_worker(rank: int, world: int, init_file: str, out_dir: str, samples) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        draft, _ = train_draft(TARGET, TOKENIZER, [2, 4], samples, out_dir=f"{out_dir}/ddp", **CONVERSATION_ARGS)
        torch.save(draft.state_dict(), f"{out_dir}/weights{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_give_the_weights_of_one(samples, tmp_path):
    import torch.multiprocessing as mp

    single, summary = train_draft(TARGET, TOKENIZER, [2, 4], samples, out_dir=tmp_path / "one", **CONVERSATION_ARGS)
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path), samples), nprocs=2, join=True)
    for rank in (0, 1):
        weights = torch.load(tmp_path / f"weights{rank}.pt", weights_only=True)
        for name, tensor in single.state_dict().items():
            # The all-reduce sums gradients in another order than one process does; Adam (lr 5e-3)
            # turns that rounding into ~4e-5 on a weight, while training on the wrong rows moves
            # weights by ~lr per step (the losses below pin the rows).
            torch.testing.assert_close(weights[name], tensor, rtol=1e-3, atol=3e-4)
    one = summary["history"]
    two = json.loads((tmp_path / "ddp" / "train_summary.json").read_text())["history"]  # written by rank 0
    assert [h["loss"] for h in two] == pytest.approx([h["loss"] for h in one], rel=1e-4)
    assert [h["tokens"] for h in two] == [h["tokens"] for h in one]


def test_warm_start_copies_the_targets_last_block_head_rows_and_norm(tmp_path):
    draft, _ = train_draft(TARGET, TOKENIZER, [2], TEXTS, out_dir=tmp_path, init="target",
                           **{**SMALL, "steps": 1, "lr": 1e-12, "warmup": 0,
                              "draft_config": {"num_attention_heads": 4, "num_key_value_heads": 2}})
    block = TARGET.model.layers[-1]
    torch.testing.assert_close(draft.midlayer.mlp.down_proj.weight, block.mlp.down_proj.weight, rtol=0, atol=1e-6)
    torch.testing.assert_close(draft.midlayer.self_attn.q_proj.weight[:, 32:], block.self_attn.q_proj.weight,
                               rtol=0, atol=1e-6)
    assert draft.midlayer.self_attn.q_proj.weight[:, :32].abs().max() < 1e-6
    rows = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size))
    torch.testing.assert_close(draft.lm_head.weight, TARGET.lm_head.weight[rows], rtol=0, atol=1e-6)
    torch.testing.assert_close(draft.norm.weight, TARGET.model.norm.weight, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="init"):
        train_draft(TARGET, TOKENIZER, [2], TEXTS, out_dir=tmp_path, init="warm", **SMALL)


def test_length_sorted_micro_batches_give_the_loss_and_weights_of_one_padded_batch(samples, tmp_path, monkeypatch):
    """A batch run as one padded group and as length-sorted groups of 1 and 3 conversations: the
    same loss curve, top-1 and weights to float tolerance (each group's loss is over the batch's
    row counts, so the gradients add up); the groups are the batch, sorted by length."""
    args = {**CONVERSATION_ARGS, "batch_size": 6, "steps": 4}
    runs = {}
    for group in (64, 3, 1):
        monkeypatch.setattr(train_mod, "MICRO_BATCH", group)
        draft, summary = train_draft(TARGET, TOKENIZER, [1, 3], samples, out_dir=tmp_path / str(group), **args)
        runs[group] = (draft.state_dict(), summary["history"])
    (one, curve), picked = runs[64], torch.arange(6)
    for group in (3, 1):
        state, history = runs[group]
        # float tolerance: other padding changes the GEMMs' summation order (and could flip a near-tie argmax)
        assert [h["loss"] for h in history] == pytest.approx([h["loss"] for h in curve], rel=1e-4)
        assert [h["top1"] for h in history] == pytest.approx([h["top1"] for h in curve], abs=0.02)
        assert [h["tokens"] for h in history] == [h["tokens"] for h in curve]
        for name, tensor in one.items():
            torch.testing.assert_close(state[name], tensor, rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(train_mod, "MICRO_BATCH", 2)
    groups = train_mod._SampleBatches(samples, None, None, "target").micro_batches(picked)
    lengths = [[len(samples[i].ids) for i in g.tolist()] for g in groups]
    assert sorted(torch.cat(groups).tolist()) == picked.tolist() and all(len(g) <= 2 for g in groups)
    assert [l for g in lengths for l in g] == sorted(len(samples[i].ids) for i in picked.tolist())


def test_warm_start_from_a_gemma3_block_keeps_the_layer_random_and_takes_norm_plus_one_and_head():
    """Gemma 3's block (q/k norms, sandwich norms, GELU) does not compute what the draft's Llama
    layer does: its weights are left at the seeded random init; the final norm (scaled by 1 + w in
    Gemma) and the head rows still transfer."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from elsi_fast.training.train import draft_config_for, init_from_target

    torch.manual_seed(0)
    target = Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, sliding_window=8, layer_types=["sliding_attention"] * 2 + ["full_attention"]))
    with torch.no_grad():
        target.model.norm.weight.normal_()
    config = draft_config_for(target, [1], draft_vocab_size=40)
    draft = Eagle3Draft(config, target.get_input_embeddings().weight)
    untouched = {name: p.detach().clone() for name, p in draft.midlayer.named_parameters()}
    init_from_target(draft, target)
    for name, p in draft.midlayer.named_parameters():
        assert torch.equal(p, untouched[name]), name
    torch.testing.assert_close(draft.norm.weight, target.model.norm.weight + 1.0, rtol=0, atol=0)
    rows = draft.draft_to_target(torch.arange(40))
    torch.testing.assert_close(draft.lm_head.weight, target.lm_head.weight[rows], rtol=0, atol=0)


def test_bf16_autocast_follows_the_fp32_loss_curve_with_fp32_master_weights(samples, tmp_path):
    """precision="bfloat16": the GEMMs in bf16, the weights, optimizer and loss in fp32; on a tiny
    draft the loss curve stays within bf16 rounding of the fp32 run's and the draft learns."""
    args = {**CONVERSATION_ARGS, "steps": 12}
    curves = {}
    for precision in ("float32", "bfloat16"):
        draft, summary = train_draft(TARGET, TOKENIZER, [2, 4], samples, out_dir=tmp_path / precision,
                                     **{**args, "precision": precision})
        assert summary["precision_this_run"] == precision and summary["precision"] == precision
        assert all(p.dtype == torch.float32 for p in draft.parameters())
        curves[precision] = [h["loss"] for h in summary["history"]]
    assert curves["bfloat16"] == pytest.approx(curves["float32"], rel=2e-2)
    assert curves["bfloat16"] != curves["float32"]  # the bf16 GEMMs did run
    assert curves["bfloat16"][-1] < curves["bfloat16"][0]


def test_auto_precision_is_bf16_only_where_the_cpu_multiplies_bf16(monkeypatch):
    from elsi_fast._infra import _backends

    cpu = torch.device("cpu")
    monkeypatch.setattr(_backends, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    assert train_mod.training_precision("auto", cpu) == "float32"
    monkeypatch.setattr(_backends, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert train_mod.training_precision("auto", cpu) == "bfloat16"
    assert train_mod.training_precision("float32", cpu) == "float32"
    with pytest.raises(ValueError, match="precision: expected one of auto, float32, bfloat16"):
        train_mod.training_precision("fp16", cpu)


def test_keep_steps_keep_the_draft_of_those_steps(samples, tmp_path):
    """Each kept folder holds the draft of its step, not the last one: the same as another run's
    at that step whatever its save_every, and other than the final weights."""
    args = {**CONVERSATION_ARGS, "steps": 6}
    train_draft(TARGET, TOKENIZER, [2], samples, out_dir=tmp_path / "long", keep_steps=(2, 5), **args)
    kept = sorted(p.name for p in (tmp_path / "long" / "checkpoints").iterdir())
    assert kept == ["step-000002", "step-000005"]
    from safetensors.torch import load_file

    weights = {name: load_file(tmp_path / "long" / "checkpoints" / name / "model.safetensors") for name in kept}
    final = load_file(tmp_path / "long" / "model.safetensors")
    assert all(any(not torch.equal(w[name], final[name]) for name in final) for w in weights.values())
    state = tmp_path / "other"
    train_draft(TARGET, TOKENIZER, [2], samples, out_dir=state, keep_steps=(2,), **{**args, "save_every": 2})
    assert all(torch.equal(load_file(state / "checkpoints" / "step-000002" / "model.safetensors")[name], tensor)
               for name, tensor in weights["step-000002"].items())
    with pytest.raises(ValueError, match="keep_steps: expected steps in 1..6"):
        train_draft(TARGET, TOKENIZER, [2], samples, out_dir=tmp_path / "bad", keep_steps=(7,), **args)


def test_init_from_continues_a_kept_draft_with_its_weights_and_vocabulary(samples, tmp_path):
    first = train_draft(TARGET, TOKENIZER, [2], samples, out_dir=tmp_path / "first", **CONVERSATION_ARGS)
    # A near-zero learning rate leaves the continued draft where the kept one ended, on other data
    # whose own most frequent tokens would give another vocabulary.
    args = {**CONVERSATION_ARGS, "steps": 1, "lr": 1e-30}
    again = train_draft(TARGET, TOKENIZER, [2], samples[:2], out_dir=tmp_path / "again",
                        init_from=tmp_path / "first", **args)
    for name, tensor in first.draft.state_dict().items():
        assert torch.equal(again.draft.state_dict()[name], tensor), name
    fresh = train_draft(TARGET, TOKENIZER, [2], samples[:2], out_dir=tmp_path / "fresh", **args)
    assert again.summary["history"][0]["loss"] < fresh.summary["history"][0]["loss"]
    assert again.summary["init_from"] == str((tmp_path / "first").resolve())
    with pytest.raises(ValueError, match=r"init_from: .* reads layers \[2\], this run \[3\]"):
        train_draft(TARGET, TOKENIZER, [3], samples, out_dir=tmp_path / "bad", init_from=tmp_path / "first", **args)
    with pytest.raises(ValueError, match="init_from: .* differs from this run's draft in draft_vocab_size"):
        train_draft(TARGET, TOKENIZER, [2], samples, out_dir=tmp_path / "bad2", init_from=tmp_path / "first",
                    **{**args, "draft_vocab_size": 8})
    with pytest.raises(ValueError, match="init_from: .* is not a readable draft folder"):
        train_draft(TARGET, TOKENIZER, [2], samples, out_dir=tmp_path / "bad3", init_from=tmp_path / "none", **args)


def test_init_from_widens_the_key_value_heads_without_changing_the_draft(samples, tmp_path):
    """More key-value heads from a kept draft: each kept head is copied to the query group it
    served, so the widened draft's logits equal the kept one's; then the groups train apart."""
    first = train_draft(TARGET, TOKENIZER, [2], samples, out_dir=tmp_path / "first", **CONVERSATION_ARGS).draft
    widened_config = {**CONVERSATION_ARGS["draft_config"], "num_key_value_heads": 2}
    args = {**CONVERSATION_ARGS, "draft_config": widened_config, "steps": 1}
    wide = train_draft(TARGET, TOKENIZER, [2], samples, out_dir=tmp_path / "wide", init_from=tmp_path / "first",
                       **{**args, "lr": 1e-30}).draft
    assert (first.config.num_key_value_heads, wide.config.num_key_value_heads) == (1, 2)
    generator = torch.Generator().manual_seed(0)
    aux = torch.randn(2, 7, first.config.fc_in_features, generator=generator)
    ids = torch.randint(0, TARGET.config.vocab_size, (2, 7), generator=generator)
    with torch.no_grad():
        want, got = first.extend(aux, ids)[0], wide.extend(aux, ids)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    trained = train_draft(TARGET, TOKENIZER, [2], samples, out_dir=tmp_path / "trained", init_from=tmp_path / "first",
                          **{**args, "steps": 3}).draft
    k = trained.midlayer.self_attn.k_proj.weight.detach().unflatten(0, (2, -1))
    assert not torch.equal(k[0], k[1])
    with pytest.raises(ValueError, match="init_from: .* differs from this run's draft in num_key_value_heads"):
        train_draft(TARGET, TOKENIZER, [2], samples, out_dir=tmp_path / "bad", init_from=tmp_path / "wide",
                    **{**args, "draft_config": CONVERSATION_ARGS["draft_config"]})


def test_grown_vocabulary_keeps_the_drafts_tokens_then_the_most_frequent_ones():
    kept, data = torch.tensor([5, 9]), torch.tensor([1, 1, 1, 2, 2, 9, 7])
    assert grown_draft_vocab_ids(kept, data, 12, 2).tolist() == [5, 9]
    assert grown_draft_vocab_ids(kept, data, 12, 4).tolist() == [1, 2, 5, 9]
    assert grown_draft_vocab_ids(kept, data, 12, 5).tolist() == [1, 2, 5, 7, 9]
    assert grown_draft_vocab_ids(kept, data, 12, 7).tolist() == [0, 1, 2, 3, 5, 7, 9]  # then unseen ids in order
    with pytest.raises(ValueError, match=r"draft_vocab_size: must be in 2..12"):
        grown_draft_vocab_ids(kept, data, 12, 1)


def test_init_from_grows_the_draft_vocabulary(samples, tmp_path):
    """A larger draft_vocab_size continues the kept draft on a wider vocabulary: its tokens keep
    their head rows (same logits), the data's most frequent other tokens join with zero rows."""
    small = {**CONVERSATION_ARGS, "draft_vocab_size": 8}
    first = train_draft(TARGET, TOKENIZER, [2], samples, out_dir=tmp_path / "first", **small).draft
    grown = train_draft(TARGET, TOKENIZER, [2], samples, out_dir=tmp_path / "grown", init_from=tmp_path / "first",
                        **{**small, "steps": 1, "lr": 1e-30, "draft_vocab_size": 20}).draft
    old = first.draft_to_target(torch.arange(8)).tolist()
    new = grown.draft_to_target(torch.arange(20)).tolist()
    counts = collections.Counter(int(t) for s in samples for t in s.ids[s.loss_mask])
    others = sorted((t for t in range(TARGET.config.vocab_size) if t not in old), key=lambda t: (-counts[t], t))
    assert new == sorted(old + others[:12])
    rows = {t: i for i, t in enumerate(new)}
    head, kept_head = grown.lm_head.weight.detach(), first.lm_head.weight.detach()
    for i, t in enumerate(old):
        assert torch.equal(head[rows[t]], kept_head[i])
    # zero rows, moved only by the 1e-30 step (the kept rows' 1e-30 steps round away)
    assert all(float(head[rows[t]].abs().max()) < 1e-25 for t in others[:12])
    mine = {k: v for k, v in grown.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    for name, tensor in first.state_dict().items():
        if name in mine:
            assert torch.equal(mine[name], tensor), name
    with pytest.raises(ValueError, match="init_from: .* differs from this run's draft in draft_vocab_size"):
        train_draft(TARGET, TOKENIZER, [2], samples, out_dir=tmp_path / "shrunk", init_from=tmp_path / "grown",
                    **{**small, "steps": 1})
    again = train_draft(TARGET, TOKENIZER, [2], samples, out_dir=tmp_path / "again", init_from=tmp_path / "grown",
                        **{**small, "steps": 1, "draft_vocab_size": None}).draft
    assert again.draft_to_target(torch.arange(20)).tolist() == new  # by default the continued draft's vocabulary


def test_answer_labels_are_each_rows_next_answer_token_in_the_draft_vocabulary(samples):
    """labels="answers": row t is labelled by the draft index of x_{t+2}; rows whose token the draft
    vocabulary lacks leave the loss; the states are those of the whole forward."""
    answers = torch.cat([s.ids[s.loss_mask] for s in samples])
    vocab_ids = draft_vocab_ids(answers, TARGET.config.vocab_size, 12)  # leaves some answer tokens out
    picked = torch.tensor([3, 0, 5])
    aux, next_ids, labels, rows, tokens = train_mod._SampleBatches(samples, None, None, "answers").features(
        TARGET, [1, 3], picked, vocab_ids, "cpu")
    want_aux, want_next, _, want_rows, want_tokens = train_mod._SampleBatches(samples, None, None, "target").features(
        TARGET, [1, 3], picked, vocab_ids, "cpu")
    torch.testing.assert_close(aux, want_aux, rtol=0, atol=0)
    assert torch.equal(next_ids, want_next) and tokens == want_tokens
    position = {int(t): j for j, t in enumerate(vocab_ids)}
    expected_rows, expected_labels = torch.zeros_like(rows), []
    for b, i in enumerate(picked.tolist()):
        ids, mask = samples[i].ids.tolist(), samples[i].loss_mask.tolist()
        for t in range(len(ids) - 2):
            if mask[t + 2] and ids[t + 2] in position:
                expected_rows[b, t] = True
                expected_labels.append(position[ids[t + 2]])
    assert 0 < int(expected_rows.sum()) < int(want_rows.sum())  # some answer tokens are outside the vocabulary
    assert torch.equal(rows, expected_rows) and labels.tolist() == expected_labels


def test_answer_labels_train_offline_from_a_cache_without_final_states(samples, tmp_path):
    from elsi_fast.training.feature_cache import build

    args = {**CONVERSATION_ARGS, "labels": "answers"}
    online = train_draft(TARGET, TOKENIZER, [1, 3], samples, out_dir=tmp_path / "online", **args)
    cache = build(TARGET, samples, [1, 3], tmp_path / "cache", batch_size=3, final=False, progress=False)
    offline = train_draft(TARGET, TOKENIZER, [1, 3], samples, out_dir=tmp_path / "offline", feature_cache=cache, **args)
    losses = [[h["loss"] for h in run.summary["history"]] for run in (online, offline)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-4) and losses[0][-1] < losses[0][0]
    for name, tensor in online.draft.state_dict().items():
        torch.testing.assert_close(offline.draft.state_dict()[name], tensor, rtol=1e-3, atol=1e-4)
    assert online.summary["labels"] == "answers" and "labels" not in train_draft(
        TARGET, TOKENIZER, [1], samples, out_dir=tmp_path / "soft", **{**CONVERSATION_ARGS, "steps": 1}).summary
    # The labels are part of a run's settings; each kind of label needs what it is made from.
    with pytest.raises(ValueError, match="resume: .* different settings"):
        train_draft(TARGET, TOKENIZER, [1, 3], samples, out_dir=tmp_path / "online", **CONVERSATION_ARGS)
    with pytest.raises(ValueError, match="feature_cache: .* holds no final states"):
        train_draft(TARGET, TOKENIZER, [1, 3], samples, out_dir=tmp_path / "bad", feature_cache=cache,
                    **CONVERSATION_ARGS)
    with pytest.raises(ValueError, match="label_temperature: labels from the answers are one-hot"):
        train_draft(TARGET, TOKENIZER, [1], samples, out_dir=tmp_path / "bad", label_temperature=0.5, **args)
    with pytest.raises(ValueError, match="labels: 'answers' needs conversation samples"):
        train_draft(TARGET, TOKENIZER, [1], TEXTS, out_dir=tmp_path / "bad", steps=1, labels="answers", **SMALL)
    with pytest.raises(ValueError, match="labels: expected 'target' or 'answers'"):
        train_draft(TARGET, TOKENIZER, [1], samples, out_dir=tmp_path / "bad", **{**args, "labels": "greedy"})
