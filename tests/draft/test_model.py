"""Eagle3Draft against an independent float64 reference written here with explicit loops and masks."""

from __future__ import annotations

import math

import pytest
import torch

from elsi_fast.draft import DraftKVCache, Eagle3Config, Eagle3Draft

from .random_draft import randomize_draft_

# ----------------------------------------------------------------------------------------------
# Independent float64 reference: per-position, per-head loops, explicit masks, softmax by hand.
# ----------------------------------------------------------------------------------------------


def ref_rmsnorm(x, weight, eps):
    return weight * x / torch.sqrt((x * x).mean() + eps)


def ref_rope(vec, position, theta):
    hd = vec.shape[0]
    half = hd // 2
    out = vec.clone()
    for i in range(half):
        angle = position * theta ** (-2.0 * i / hd)
        a, b = vec[i], vec[i + half]
        out[i] = a * math.cos(angle) - b * math.sin(angle)
        out[i + half] = b * math.cos(angle) + a * math.sin(angle)
    return out


class Reference:
    """The EAGLE3 layer on one (hidden, token, position) entry at a time, in float64."""

    def __init__(self, draft: Eagle3Draft, embed: torch.Tensor):
        self.cfg = draft.config
        self.p = {k: v.detach().to(torch.float64) for k, v in draft.state_dict().items()}
        self.embed = embed.to(torch.float64)

    def project(self, aux):
        """aux [..., m * d_t] -> fc input after the optional norms, one position at a time."""
        c, p = self.cfg, self.p
        rows = aux.to(torch.float64).reshape(-1, aux.shape[-1])
        out = []
        for row in rows:
            if c.norm_before_fc:
                row = ref_rmsnorm(row, p["input_norm.weight"], c.rms_norm_eps)
            if c.fc_norm:
                d_t = c.target_hidden_size
                row = torch.cat([ref_rmsnorm(row[i * d_t:(i + 1) * d_t], p[f"fc_norm.{i}.weight"], c.rms_norm_eps)
                                 for i in range(c.num_aux_layers)])
            out.append(p["fc.weight"] @ row)
        return torch.stack(out).reshape(*aux.shape[:-1], -1)

    def qkv(self, hidden, token, position):
        c, p = self.cfg, self.p
        x = torch.cat([ref_rmsnorm(self.embed[token], p["midlayer.input_layernorm.weight"], c.rms_norm_eps),
                       ref_rmsnorm(hidden, p["midlayer.hidden_norm.weight"], c.rms_norm_eps)])
        q = (p["midlayer.self_attn.q_proj.weight"] @ x).view(c.num_attention_heads, c.head_dim)
        k = (p["midlayer.self_attn.k_proj.weight"] @ x).view(c.num_key_value_heads, c.head_dim)
        v = (p["midlayer.self_attn.v_proj.weight"] @ x).view(c.num_key_value_heads, c.head_dim)
        if c.qk_norm:  # Qwen3: each head's q and k normalized before RoPE
            q = torch.stack([ref_rmsnorm(q[h], p["midlayer.self_attn.q_norm.weight"], c.rms_norm_eps)
                             for h in range(c.num_attention_heads)])
            k = torch.stack([ref_rmsnorm(k[h], p["midlayer.self_attn.k_norm.weight"], c.rms_norm_eps)
                             for h in range(c.num_key_value_heads)])
        q = torch.stack([ref_rope(q[h], position, c.rope_theta) for h in range(c.num_attention_heads)])
        k = torch.stack([ref_rope(k[h], position, c.rope_theta) for h in range(c.num_key_value_heads)])
        return q, k, v

    def window(self, t):
        """Positions that position t attends among step-0 entries (all of 0..t without a window)."""
        w = self.cfg.sliding_window
        return range(0 if w is None else max(0, t - w + 1), t + 1)

    def finish(self, hidden, q, keys, values):
        """Attention of one query over the given key/value entries, then o_proj, MLP, norm, lm_head."""
        c, p = self.cfg, self.p
        group = c.num_attention_heads // c.num_key_value_heads
        heads = []
        for h in range(c.num_attention_heads):
            kv = h // group
            scores = [float(q[h] @ k[kv]) / math.sqrt(c.head_dim) for k in keys]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            heads.append(sum(w / total * v[kv] for w, v in zip(weights, values)))
        residual = ref_rmsnorm(hidden, p["midlayer.hidden_norm.weight"], c.rms_norm_eps) \
            if c.norm_before_residual else hidden
        h1 = residual + p["midlayer.self_attn.o_proj.weight"] @ torch.cat(heads)
        post = ref_rmsnorm(h1, p["midlayer.post_attention_layernorm.weight"], c.rms_norm_eps)
        gate, up = p["midlayer.mlp.gate_proj.weight"] @ post, p["midlayer.mlp.up_proj.weight"] @ post
        h2 = h1 + p["midlayer.mlp.down_proj.weight"] @ (gate / (1 + torch.exp(-gate)) * up)
        normed = ref_rmsnorm(h2, p["norm.weight"], c.rms_norm_eps)
        logits = p["lm_head.weight"] @ (normed if c.final_norm else h2)
        return logits, normed if c.norm_feedback else h2

    def causal(self, hidden, tokens):
        """hidden [T, d] float64, tokens [T]: every position t attends positions <= t."""
        hidden = hidden.detach()
        entries = [self.qkv(hidden[t], int(tokens[t]), t) for t in range(len(tokens))]
        outs = [self.finish(hidden[t], entries[t][0], [entries[s][1] for s in self.window(t)],
                            [entries[s][2] for s in self.window(t)]) for t in range(len(tokens))]
        return torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])

    def ttt(self, hidden0, next_ids, num_steps):
        """Training-time test with an explicit mask over all (step, position) entries."""
        seq = len(next_ids)
        hidden0 = hidden0.detach()
        entries = {}  # (step, position) -> (k, v)
        hidden, all_logits = hidden0, []
        for step in range(num_steps):
            ids = [int(next_ids[t + step]) if t + step < seq else 0 for t in range(seq)]
            qs = {}
            for t in range(seq):
                q, k, v = self.qkv(hidden[t], ids[t], t + step)
                qs[t], entries[(step, t)] = q, (k, v)
            logits, outs = [], []
            for t in range(seq):
                allowed = [(0, s) for s in self.window(t)] + [(j, t) for j in range(1, step + 1)]
                lo, h = self.finish(hidden[t], qs[t], [entries[e][0] for e in allowed],
                                    [entries[e][1] for e in allowed])
                logits.append(lo)
                outs.append(h)
            all_logits.append(torch.stack(logits))
            hidden = torch.stack(outs)
        return all_logits


# ----------------------------------------------------------------------------------------------


def make_config(m=2, d=24, heads=4, kv=2, head_dim=None, inter=40, vocab=61, draft_vocab=29, theta=10000.0,
                **variants):
    return Eagle3Config(hidden_size=d, intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv,
                        head_dim=head_dim, vocab_size=vocab, draft_vocab_size=draft_vocab, target_hidden_size=d + 4,
                        rope_theta=theta, rms_norm_eps=1e-5, aux_layer_ids=tuple(range(1, 2 * m, 2)), **variants)


def make_draft(cfg, dtype=torch.float64, seed=0):
    """A draft with every weight random (norm weights too) and a random sorted draft vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen, dtype=torch.float64)
    draft = randomize_draft_(Eagle3Draft(cfg, embed), gen)
    return draft.to(dtype), embed


def random_inputs(cfg, batch, seq, dtype=torch.float64, seed=1):
    gen = torch.Generator().manual_seed(seed)
    aux = torch.randn(batch, seq, cfg.fc_in_features, generator=gen, dtype=torch.float64).to(dtype)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    return aux, ids


CONFIGS = {
    "m1-gqa": dict(m=1),
    "m2-gqa": dict(m=2),
    "m3-mha": dict(m=3, kv=4),
    # odd sizes; head_dim != hidden / heads; a single KV head shared by three query heads
    "m2-odd": dict(m=2, d=21, heads=3, kv=1, head_dim=10, inter=37, vocab=53, draft_vocab=53, theta=500000.0),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_extend_then_decode_matches_reference_and_one_full_forward(name):
    cfg = make_config(**CONFIGS[name])
    draft, embed = make_draft(cfg)
    ref = Reference(draft, embed)
    prefix, steps = 4, 3
    aux, ids = random_inputs(cfg, 1, prefix + steps)
    cache = draft.new_cache(max_len=prefix + steps)

    logits, hidden_out = draft.extend(aux[:, :prefix], ids[:, :prefix], cache)
    hidden_in = [draft.project(aux[:, :prefix])]
    all_logits, all_hidden = [logits], [hidden_out]
    for s in range(steps):
        pos = prefix + s
        # alternate the two decode inputs: the fed-back hidden state, and fresh target features
        from_target = s == 1
        x = aux[:, pos:pos + 1] if from_target else all_hidden[-1][:, -1:]
        lo, h = draft.forward(draft.project(x) if from_target else x, ids[:, pos:pos + 1], cache)
        hidden_in.append(draft.project(x) if from_target else x)
        all_logits.append(lo)
        all_hidden.append(h)
    assert cache.length == prefix + steps
    stepped_logits, stepped_hidden = torch.cat(all_logits, 1), torch.cat(all_hidden, 1)

    full_logits, full_hidden = draft.forward(torch.cat(hidden_in, 1), ids)
    torch.testing.assert_close(stepped_logits, full_logits, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(stepped_hidden, full_hidden, rtol=1e-12, atol=1e-12)

    ref_logits, ref_hidden = ref.causal(torch.cat(hidden_in, 1)[0], ids[0])
    torch.testing.assert_close(full_logits[0], ref_logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(full_hidden[0], ref_hidden, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 6e-2)])
def test_low_precision_close_to_float64_reference(dtype, tol):
    cfg = make_config(m=3)
    draft64, embed = make_draft(cfg)
    aux, ids = random_inputs(cfg, 1, 6)
    ref_logits, _ = Reference(draft64, embed).causal(draft64.project(aux)[0], ids[0])
    draft, _ = make_draft(cfg, dtype=dtype)
    logits, _ = draft.extend(aux.to(dtype), ids, draft.new_cache(6))
    scale = ref_logits.abs().max()
    assert (logits[0].double() - ref_logits).abs().max() / scale < tol


def test_batch_rows_match_single_row_runs():
    cfg = make_config(m=2)
    draft, _ = make_draft(cfg)
    aux, ids = random_inputs(cfg, 3, 5)
    cache = draft.new_cache(8, batch_size=3)
    batched, _ = draft.extend(aux, ids, cache)
    for row in range(3):
        single, _ = draft.extend(aux[row:row + 1], ids[row:row + 1], draft.new_cache(8))
        torch.testing.assert_close(batched[row:row + 1], single, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("top_k", [1, 4])
def test_decode_step_topk_ids_and_d2t_remap_exact(top_k):
    cfg = make_config(m=1)
    draft, embed = make_draft(cfg)
    vocab_ids = (torch.arange(cfg.draft_vocab_size) + draft.d2t).tolist()  # draft id -> target id
    aux, ids = random_inputs(cfg, 2, 5)
    cache = draft.new_cache(6, batch_size=2)
    _, hidden_out = draft.extend(aux[:, :4], ids[:, :4], cache)
    target_ids, h = draft.decode_step(hidden_out[:, -1:], ids[:, 4:5], cache, from_target=False, top_k=top_k)
    assert target_ids.shape == (2, top_k) and target_ids.dtype == torch.int64
    ref = Reference(draft, embed)
    hidden_seq = torch.cat([draft.project(aux[:, :4]), hidden_out[:, -1:]], 1)
    for row in range(2):
        ref_logits, ref_hidden = ref.causal(hidden_seq[row], ids[row])
        best = sorted(range(cfg.draft_vocab_size), key=lambda i: -float(ref_logits[-1, i]))[:top_k]
        assert target_ids[row].tolist() == [vocab_ids[i] for i in best]
        torch.testing.assert_close(h[row, 0], ref_hidden[-1], rtol=1e-10, atol=1e-10)
    assert all(t in vocab_ids for t in target_ids.flatten().tolist())
    assert bool(draft.t2d[target_ids].all())


def test_decode_step_from_target_projects_first():
    cfg = make_config(m=2)
    draft, _ = make_draft(cfg)
    aux, ids = random_inputs(cfg, 1, 3)
    cache_a, cache_b = draft.new_cache(3), draft.new_cache(3)
    draft.extend(aux[:, :2], ids[:, :2], cache_a)
    draft.extend(aux[:, :2], ids[:, :2], cache_b)
    got, h = draft.decode_step(aux[:, 2:], ids[:, 2:], cache_a, from_target=True, top_k=3)
    logits, h_ref = draft.extend(aux[:, 2:], ids[:, 2:], cache_b)
    assert got.tolist() == draft.draft_to_target(logits[:, -1].topk(3).indices).tolist()
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["m1-gqa", "m2-odd"])
def test_ttt_forward_matches_explicit_mask_reference(name):
    cfg = make_config(**CONFIGS[name])
    draft, embed = make_draft(cfg)
    aux, ids = random_inputs(cfg, 2, 5)
    steps = draft.ttt_forward(aux, ids, num_steps=3)
    assert len(steps) == 3
    torch.testing.assert_close(steps[0], draft.forward(draft.project(aux), ids)[0], rtol=1e-12, atol=1e-12)
    ref = Reference(draft, embed)
    for row in range(2):
        expected = ref.ttt(draft.project(aux)[row], ids[row], 3)
        for got, want in zip(steps, expected):
            torch.testing.assert_close(got[row], want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ["m1-gqa", "m2-odd"])
def test_ttt_forward_with_label_rows_gives_the_full_logits_at_those_rows(name):
    """label_rows: step i's logits are the full run's at (b, s - i) for the label rows (b, s) with
    s >= i, in nonzero() order; an empty selection gives no rows."""
    cfg = make_config(**CONFIGS[name])
    draft, _ = make_draft(cfg)
    aux, ids = random_inputs(cfg, 3, 7)
    full = draft.ttt_forward(aux, ids, num_steps=3)
    rows = torch.rand(3, 7, generator=torch.Generator().manual_seed(4)) > 0.5
    late = torch.zeros(3, 7, dtype=torch.bool)  # a prompt of 5: the later steps skip positions 0..2
    late[0, 5:], late[1, 6:], late[2, 5] = True, True, True
    for selected in (rows, late):
        packed = draft.ttt_forward(aux, ids, num_steps=3, label_rows=selected)
        for step, (got, want) in enumerate(zip(packed, full)):
            expected = [want[b, s - step] for b, s in selected.nonzero().tolist() if s >= step]
            assert got.shape == (len(expected), cfg.draft_vocab_size)
            torch.testing.assert_close(got, torch.stack(expected), rtol=1e-12, atol=1e-12)
    empty = draft.ttt_forward(aux, ids, num_steps=2, label_rows=torch.zeros(3, 7, dtype=torch.bool))
    assert [tuple(s.shape) for s in empty] == [(0, cfg.draft_vocab_size)] * 2
    with pytest.raises(ValueError, match="label_rows"):
        draft.ttt_forward(aux, ids, num_steps=2, label_rows=rows[:, :5])


def test_ttt_step_equals_inference_chain_with_rollback():
    """Step i at position t of the training-time test is what inference computes: extend pairs
    0..t with target features, then i draft steps feeding back hidden_out with the true next
    tokens; truncating back to t+1 discards those steps (speculative-decoding rollback)."""
    cfg = make_config(m=2)
    draft, _ = make_draft(cfg)
    aux, ids = random_inputs(cfg, 1, 6)
    num_steps = 3
    ttt = draft.ttt_forward(aux, ids, num_steps)
    cache = draft.new_cache(6 + num_steps)
    for t in range(6 - num_steps + 1):
        logits, hidden = draft.extend(aux[:, t:t + 1], ids[:, t:t + 1], cache)
        torch.testing.assert_close(logits[0, 0], ttt[0][0, t], rtol=1e-12, atol=1e-12)
        for step in range(1, num_steps):
            logits, hidden = draft.forward(hidden, ids[:, t + step:t + step + 1], cache)
            torch.testing.assert_close(logits[0, 0], ttt[step][0, t], rtol=1e-12, atol=1e-12)
        cache.truncate(t + 1)


def test_cache_overflow_and_truncate_errors():
    cfg = make_config(m=1)
    draft, _ = make_draft(cfg)
    aux, ids = random_inputs(cfg, 1, 5)
    cache = draft.new_cache(4)
    with pytest.raises(ValueError, match="max_len=4"):
        draft.extend(aux, ids, cache)
    draft.extend(aux[:, :3], ids[:, :3], cache)
    with pytest.raises(ValueError, match="max_len=4"):
        draft.extend(aux[:, 3:5], ids[:, 3:5], cache)
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(5)
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(-1)
    with pytest.raises(ValueError, match="max_len"):
        DraftKVCache(1, 2, 4, 0)


def test_missing_embedding_and_bad_inputs():
    cfg = make_config(m=2)
    draft, embed = make_draft(cfg)
    aux, ids = random_inputs(cfg, 1, 3)
    bare = Eagle3Draft(cfg).double()
    with pytest.raises(ValueError, match="embed_tokens"):
        bare.extend(aux, ids, None)
    with pytest.raises(ValueError, match="embed_tokens has shape"):
        Eagle3Draft(cfg, embed[:, :-1])
    with pytest.raises(ValueError, match=r"m \* target_hidden_size = 2 \* 28"):
        draft.project(aux[..., :-1])
    with pytest.raises(TypeError, match="dtype"):
        draft.extend(aux.float(), ids, None)
    with pytest.raises(ValueError, match="on meta"):
        draft.forward(torch.empty(1, 3, cfg.hidden_size, dtype=torch.float64, device="meta"), ids)
    with pytest.raises(TypeError, match="input_ids"):
        draft.extend(aux, ids.double(), None)
    with pytest.raises(ValueError, match="input_ids must have shape"):
        draft.extend(aux, ids[:, :2], None)
    with pytest.raises(ValueError, match="cache has"):
        draft.extend(aux, ids, draft.new_cache(4, batch_size=2))
    with pytest.raises(ValueError, match="cache is"):
        draft.extend(aux, ids, draft.new_cache(4, dtype=torch.float32))
    with pytest.raises(ValueError, match="position_ids"):
        draft.forward(draft.project(aux), ids, position_ids=torch.arange(4))
    with pytest.raises(ValueError, match="top_k"):
        draft.decode_step(aux[:, :1], ids[:, :1], draft.new_cache(2), from_target=True, top_k=0)
    with pytest.raises(ValueError, match="num_steps"):
        draft.ttt_forward(aux, ids, 0)
    with pytest.raises(ValueError, match="strictly increasing"):
        draft.set_draft_vocab(torch.arange(cfg.draft_vocab_size).flip(0))


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
    (dict(aux_layer_ids=(5, 2)), "strictly increasing"),
    (dict(aux_layer_ids=()), "non-negative ints"),
    (dict(draft_vocab_size=100), "exceeds vocab_size"),
    (dict(head_dim=7), "even"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "yarn"),
])
def test_config_rejects_bad_values(kwargs, match):
    base = dict(hidden_size=16, intermediate_size=8, num_attention_heads=4, num_key_value_heads=2, vocab_size=50)
    with pytest.raises(ValueError, match=match):
        Eagle3Config(**{**base, **kwargs})


@pytest.mark.parametrize("m,expected_millions", [(3, 424.7), (1, 391.1)])
def test_llama31_8b_trainable_parameters_match_design(m, expected_millions):
    cfg = Eagle3Config(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, vocab_size=128256, draft_vocab_size=32000,
                       aux_layer_ids=(2, 16, 29) if m == 3 else (16,))
    with torch.device("meta"):
        draft = Eagle3Draft(cfg)
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    assert round(trainable / 1e6, 1) == expected_millions
    assert draft.fc.weight.shape == (4096, m * 4096)


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cfg = Eagle3Config(hidden_size=512, intermediate_size=8, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=10, rope_theta=500000.0, rope_scaling=scaling)
    hf = LlamaConfig(hidden_size=512, num_attention_heads=4, num_key_value_heads=2,
                     rope_parameters={"rope_theta": 500000.0, **scaling})
    expected = LlamaRotaryEmbedding(hf).inv_freq
    got = Eagle3Draft(cfg).rope_inv_freq("cpu")
    torch.testing.assert_close(got, expected.float(), rtol=1e-6, atol=0)
    plain = Eagle3Draft(Eagle3Config(**{**cfg.__dict__, "rope_scaling": None})).rope_inv_freq("cpu")
    assert not torch.allclose(got, plain)  # the scaled band really differs


def test_ttt_gradients_reach_every_trainable_weight_but_not_the_embedding():
    cfg = make_config(m=2)
    draft, _ = make_draft(cfg, dtype=torch.float32)
    aux, ids = random_inputs(cfg, 2, 4, dtype=torch.float32)
    steps = draft.ttt_forward(aux, ids, num_steps=2)
    # only the last step's loss: its gradient reaches fc through the fed-back step-0 hidden state
    torch.nn.functional.cross_entropy(steps[1].flatten(0, 1), ids.flatten() % cfg.draft_vocab_size).backward()
    for name, param in draft.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    assert not draft.embed_tokens.weight.requires_grad
    assert "embed_tokens.weight" not in draft.state_dict()


# ----------------------------------------------------------------------------------------------
# Architecture variants (speculators, SpecForge, Qwen3 layers, sliding-window attention)
# ----------------------------------------------------------------------------------------------

VARIANTS = {
    "norm_before_residual": dict(norm_before_residual=True),
    "norm_before_fc": dict(norm_before_fc=True),
    "fc_norm": dict(fc_norm=True),
    "norm_feedback": dict(norm_feedback=True),
    "no_final_norm": dict(final_norm=False),
    "qk_norm": dict(qk_norm=True),
    "sliding_window": dict(sliding_window=3),
    # speculators' training defaults together, on a window shorter than the sequence
    "speculators_defaults": dict(norm_before_residual=True, norm_before_fc=True, norm_feedback=True,
                                 sliding_window=2),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_reference_and_changes_the_math(name):
    cfg = make_config(m=3, **VARIANTS[name])
    draft, embed = make_draft(cfg)
    ref = Reference(draft, embed)
    aux, ids = random_inputs(cfg, 1, 6)
    projected = draft.project(aux)
    torch.testing.assert_close(projected[0], ref.project(aux[0]), rtol=1e-10, atol=1e-10)

    logits, hidden = draft.forward(projected, ids)
    ref_logits, ref_hidden = ref.causal(projected[0], ids[0])
    torch.testing.assert_close(logits[0], ref_logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(hidden[0], ref_hidden, rtol=1e-10, atol=1e-10)

    steps = draft.ttt_forward(aux, ids, num_steps=3)
    for got, want in zip(steps, ref.ttt(projected[0], ids[0], 3)):
        torch.testing.assert_close(got[0], want, rtol=1e-10, atol=1e-10)

    # The same weights read as the plain layer compute something else (so the variant is not a no-op).
    plain = Eagle3Draft(make_config(m=3), embed).double()
    plain_keys = set(plain.state_dict())
    plain.load_state_dict({k: v for k, v in draft.state_dict().items() if k in plain_keys})
    with torch.no_grad():
        plain_steps = plain.ttt_forward(aux, ids, num_steps=3)
        assert max(float((a - b).abs().max()) for a, b in zip(steps, plain_steps)) > 1e-3


@pytest.mark.parametrize("name", ["norm_feedback", "speculators_defaults", "qk_norm"])
def test_variant_drafts_are_refused_by_the_native_plan(name, monkeypatch):
    """fp32 weights, which the native op would take: a variant draft must still decode on the torch
    path (the op implements the plain layer), and the plan says why."""
    from elsi_fast.draft import native

    monkeypatch.delenv(native.DISABLE_NATIVE_ENV, raising=False)
    cfg = make_config(m=2, **VARIANTS[name])
    draft, _ = make_draft(cfg, dtype=torch.float32)
    decoder, reason = native.plan_decoder(draft, 8)
    assert decoder is None and reason == cfg.native_unsupported_reason() and reason.startswith("variant ")
    with pytest.raises(ValueError, match="NativeDraftDecoder cannot run this draft: variant "):
        native.NativeDraftDecoder(draft, "fp32", 8)
    assert make_config(m=2).native_unsupported_reason() is None


def test_norm_feedback_ttt_step_equals_inference_chain():
    """With norm_feedback the inference chain feeds hidden_out (now norm(h'')) back, as the
    training-time test does."""
    cfg = make_config(m=2, norm_feedback=True)
    draft, _ = make_draft(cfg)
    aux, ids = random_inputs(cfg, 1, 5)
    ttt = draft.ttt_forward(aux, ids, 3)
    cache = draft.new_cache(8)
    for t in range(3):
        logits, hidden = draft.extend(aux[:, t:t + 1], ids[:, t:t + 1], cache)
        for step in range(1, 3):
            logits, hidden = draft.forward(hidden, ids[:, t + step:t + step + 1], cache)
            torch.testing.assert_close(logits[0, 0], ttt[step][0, t], rtol=1e-12, atol=1e-12)
        cache.truncate(t + 1)


@pytest.mark.parametrize("kwargs,match", [
    (dict(norm_before_fc=True, fc_norm=True), "exclusive"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(norm_feedback=1), "norm_feedback must be a bool"),
])
def test_config_rejects_bad_variants(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make_config(m=1, **kwargs)
