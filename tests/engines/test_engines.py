"""Drafts round-trip between elsi-fast and the real speculators 0.9.0 / SpecForge 0.2.0 packages.

Both directions, m = 1 and m = 3, fp32, three training-time-test steps, a non-identity draft
vocabulary (d2t), and the architecture switches those packages train with: the logits of every
step agree to 1e-5. The packages run in their own environment (engine_env.py); one subprocess
computes all their outputs, and each test compares one case here.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from elsi_fast.draft import Eagle3Config, Eagle3Draft, read_draft, write_draft

from draft.random_draft import randomize_draft_  # tests/ is on sys.path (rootdir import)

from .engine_env import engines_python, run_jobs

TOLERANCE = 1e-5
STEPS = 3
SEQ = 128  # speculators extends its flex-attention block mask per TTT step in whole 128-token blocks
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 32, 4, 2, 8, 48
VOCAB, DRAFT_VOCAB, TARGET_BLOCKS = 96, 40, 6

# elsi-fast drafts saved for speculators (with the embedding, the default): (m, Eagle3Config variants)
TO_SPECULATORS = {
    "m1": (1, {}),
    "m3": (3, {}),
    "m3-speculators-defaults": (3, dict(norm_before_residual=True, norm_before_fc=True, norm_feedback=True,
                                        sliding_window=5)),
    "m3-qwen3-fc-norm": (3, dict(qk_norm=True, fc_norm=True)),
}
# drafts created by speculators itself: (m, Eagle3SpeculatorConfig switches, layer model_type, layer extras,
# the Eagle3Config variants elsi-fast must read them as)
FROM_SPECULATORS = {
    "m1": (1, {}, "llama", {}, {}),
    "m3-defaults-sliding": (3, dict(norm_before_residual=True, norm_before_fc=True, norm_output=True), "llama",
                            dict(layer_types=["sliding_attention"], sliding_window=4),
                            dict(norm_before_residual=True, norm_before_fc=True, norm_feedback=True, sliding_window=4)),
    "m3-qwen3-fc-norm": (3, dict(fc_norm=True), "qwen3", {}, dict(fc_norm=True, qk_norm=True)),
}
# SpecForge: its draft has a 3-state fc, and target_hidden_size may differ from hidden_size
TO_SPECFORGE = {"m3": {}}
FROM_SPECFORGE = {"m3": dict(norm_output=True), "m3-no-final-norm": dict(norm_output=False)}
TARGET_HIDDEN_SPECFORGE = 24


def aux_ids(m: int, target_hidden: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    gen = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, SEQ, m * target_hidden, generator=gen)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=gen)
    return aux.numpy(), ids.numpy()


def layer_ids(m: int) -> list[int]:
    return [3] if m == 1 else [1, 3, TARGET_BLOCKS]  # h_N included: speculators and vLLM capture it


def elsi_draft(m: int, variants: dict, seed: int, target_hidden: int = HIDDEN) -> tuple[Eagle3Draft, torch.Tensor]:
    cfg = Eagle3Config(hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=HEADS,
                       num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB,
                       target_hidden_size=target_hidden, rms_norm_eps=1e-5, rope_theta=50000.0,
                       aux_layer_ids=tuple(layer_ids(m)), **variants)
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen)
    return randomize_draft_(Eagle3Draft(cfg, embed), gen), embed


def layer_fields(**extra) -> dict:
    return dict(hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                head_dim=HEAD_DIM, vocab_size=VOCAB, num_hidden_layers=1, rms_norm_eps=1e-5,
                max_position_embeddings=256, **extra)


def elsi_logits(draft: Eagle3Draft, aux: np.ndarray, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        steps = draft.ttt_forward(torch.from_numpy(aux), torch.from_numpy(ids), STEPS)
    return torch.cat(steps).numpy()


@pytest.fixture(scope="session")
def engine_results(tmp_path_factory):
    """Every case's files and outputs: {(direction, name): dict}, from one engine-runner run."""
    python = engines_python()
    root = tmp_path_factory.mktemp("engines")
    from transformers import LlamaConfig, LlamaForCausalLM

    target_dir = root / "target"
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=HEADS,
                                          num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=VOCAB,
                                          num_hidden_layers=TARGET_BLOCKS))
    target.save_pretrained(target_dir)
    target.config._name_or_path = str(target_dir)  # the verifier speculators reads the layer count from

    cases, expected = [], {}
    for seed, (name, (m, variants)) in enumerate(TO_SPECULATORS.items()):
        draft, _ = elsi_draft(m, variants, seed)
        path = root / f"to-spec-{name}"
        write_draft(draft, path, format="speculators", target_config=target.config)
        aux, ids = aux_ids(m, HIDDEN, seed)
        np.savez(root / f"to-spec-{name}-in.npz", aux=aux, ids=ids)
        cases.append({"kind": "speculators_load", "path": str(path), "inputs": str(root / f"to-spec-{name}-in.npz"),
                      "steps": STEPS, "out": str(root / f"to-spec-{name}-out.npz")})
        expected[("to_speculators", name)] = {"draft": draft, "aux": aux, "ids": ids, "m": m}
    for seed, (name, (m, switches, model_type, extra, _)) in enumerate(FROM_SPECULATORS.items(), start=10):
        aux, ids = aux_ids(m, HIDDEN, seed)
        np.savez(root / f"from-spec-{name}-in.npz", aux=aux, ids=ids)
        config = {"transformer_layer_config": {"model_type": model_type, **layer_fields(**extra)},
                  "draft_vocab_size": DRAFT_VOCAB, "eagle_aux_hidden_state_layer_ids": layer_ids(m), **switches}
        cases.append({"kind": "speculators_create", "config": config, "seed": seed,
                      "path": str(root / f"from-spec-{name}"), "inputs": str(root / f"from-spec-{name}-in.npz"),
                      "steps": STEPS, "out": str(root / f"from-spec-{name}-out.npz")})
        expected[("from_speculators", name)] = {"aux": aux, "ids": ids, "m": m}
    for seed, (name, variants) in enumerate(TO_SPECFORGE.items(), start=20):
        draft, _ = elsi_draft(3, variants, seed, target_hidden=TARGET_HIDDEN_SPECFORGE)
        path = root / f"to-sf-{name}"
        write_draft(draft, path, include_embedding=True)
        aux, ids = aux_ids(3, TARGET_HIDDEN_SPECFORGE, seed)
        np.savez(root / f"to-sf-{name}-in.npz", aux=aux, ids=ids)
        cases.append({"kind": "specforge_load", "path": str(path), "inputs": str(root / f"to-sf-{name}-in.npz"),
                      "steps": STEPS, "out": str(root / f"to-sf-{name}-out.npz")})
        expected[("to_specforge", name)] = {"draft": draft, "aux": aux, "ids": ids, "m": 3}
    for seed, (name, switches) in enumerate(FROM_SPECFORGE.items(), start=30):
        aux, ids = aux_ids(3, TARGET_HIDDEN_SPECFORGE, seed)
        np.savez(root / f"from-sf-{name}-in.npz", aux=aux, ids=ids)
        config = {"model_type": "llama", **layer_fields(), "draft_vocab_size": DRAFT_VOCAB,
                  "target_hidden_size": TARGET_HIDDEN_SPECFORGE, "rope_theta": 50000.0,
                  "architectures": ["LlamaForCausalLMEagle3"],
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}, **switches}
        cases.append({"kind": "specforge_create", "config": config, "seed": seed,
                      "path": str(root / f"from-sf-{name}"), "inputs": str(root / f"from-sf-{name}-in.npz"),
                      "steps": STEPS, "out": str(root / f"from-sf-{name}-out.npz")})
        expected[("from_specforge", name)] = {"aux": aux, "ids": ids, "m": 3}

    jobs = root / "jobs.json"
    jobs.write_text(json.dumps({"cases": cases}))
    run_jobs(python, jobs)
    for case, key in zip(cases, expected):
        expected[key]["engine"] = dict(np.load(case["out"]))
        expected[key]["path"] = case["path"]
    return expected


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())


@pytest.mark.parametrize("name", list(TO_SPECULATORS))
def test_speculators_loads_elsi_fast_draft_in_one_call(engine_results, name):
    case = engine_results[("to_speculators", name)]
    draft, engine = case["draft"], case["engine"]
    assert engine["class"] == "Eagle3DraftModel"
    assert engine["target_layer_ids"].tolist() == list(draft.config.aux_layer_ids)
    assert np.array_equal(engine["d2t"], draft.d2t.numpy()) and np.array_equal(engine["t2d"], draft.t2d.numpy())
    diff = max_diff(engine["logits"], elsi_logits(draft, case["aux"], case["ids"]))
    print(f"elsi-fast -> speculators {name}: max |logit diff| over {STEPS} TTT steps = {diff:.2e}")
    assert diff <= TOLERANCE


@pytest.mark.parametrize("name", list(FROM_SPECULATORS))
def test_elsi_fast_loads_speculators_draft(engine_results, name):
    case = engine_results[("from_speculators", name)]
    draft = read_draft(case["path"])  # format detected, embedding from the checkpoint
    assert draft.config.num_aux_layers == case["m"] and list(draft.config.aux_layer_ids) == layer_ids(case["m"])
    assert draft.config.variants == FROM_SPECULATORS[name][4]
    assert np.array_equal(draft.d2t.numpy(), case["engine"]["d2t"])
    assert np.array_equal(draft.embed_tokens.weight.numpy(), case["engine"]["embed"])
    diff = max_diff(case["engine"]["logits"], elsi_logits(draft, case["aux"], case["ids"]))
    print(f"speculators -> elsi-fast {name}: max |logit diff| over {STEPS} TTT steps = {diff:.2e}")
    assert diff <= TOLERANCE


@pytest.mark.parametrize("name", list(TO_SPECFORGE))
def test_specforge_warm_starts_from_elsi_fast_draft(engine_results, name):
    case = engine_results[("to_specforge", name)]
    draft = case["draft"]
    assert np.array_equal(case["engine"]["d2t"], draft.d2t.numpy())
    diff = max_diff(case["engine"]["logits"], elsi_logits(draft, case["aux"], case["ids"]))
    print(f"elsi-fast -> SpecForge {name}: max |logit diff| over {STEPS} TTT steps = {diff:.2e}")
    assert diff <= TOLERANCE


@pytest.mark.parametrize("name", list(FROM_SPECFORGE))
def test_elsi_fast_loads_specforge_draft(engine_results, name):
    case = engine_results[("from_specforge", name)]
    with pytest.raises(ValueError, match="two meanings"):
        read_draft(case["path"])
    draft = read_draft(case["path"], norm_output_meaning="specforge")
    assert draft.config.final_norm is FROM_SPECFORGE[name]["norm_output"]
    assert list(draft.config.aux_layer_ids) == [1, 3, 5]  # SpecForge's output-of-layer ids, plus one
    assert np.array_equal(draft.d2t.numpy(), case["engine"]["d2t"])
    diff = max_diff(case["engine"]["logits"], elsi_logits(draft, case["aux"], case["ids"]))
    print(f"SpecForge -> elsi-fast {name}: max |logit diff| over {STEPS} TTT steps = {diff:.2e}")
    assert diff <= TOLERANCE
