"""Runs inside the engines environment (engine_env.py), never in elsi-fast's: loads or creates EAGLE3
drafts with speculators 0.9.0 / SpecForge 0.2.0 and writes their training-time-test logits.

    python engine_runner.py jobs.json

jobs.json: {"cases": [case, ...]}; each case has "kind", "path" (a checkpoint directory), "inputs"
(an .npz with aux [1, T, m * d] float32 and ids [1, T] int64), "steps" and "out" (an .npz to
write: logits [steps, T, draft_vocab] float32, d2t, t2d, and for created drafts the embedding).

kinds:
  speculators_load    SpeculatorModel.from_pretrained(path), one call, as a user would
  speculators_create  build an Eagle3DraftModel from "config" with random weights, save_pretrained(path)
  specforge_load      LlamaForCausalLMEagle3 + SpecForge's warm-start loader on path
  specforge_create    build a LlamaForCausalLMEagle3 from "config" with random weights, save_pretrained(path)
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import torch


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random: norm weights around 1, matrices scaled by 1/sqrt(fan_in)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.dim() == 1:
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[1]))


def vocab_maps(vocab: int, draft_vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random sorted draft vocabulary as (t2d [vocab] bool, d2t [draft_vocab] int64 offsets)."""
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return t2d, ids - torch.arange(draft_vocab)


def layer_config(spec: dict):
    from transformers import LlamaConfig, Qwen3Config

    kind = {"llama": LlamaConfig, "qwen3": Qwen3Config}[spec.pop("model_type", "llama")]
    return kind(**spec)


# ------------------------------------------------------------------------------------------ speculators


def speculators_logits(model, aux: torch.Tensor, ids: torch.Tensor, steps: int) -> np.ndarray:
    """The logits of each training-time-test step of speculators' own forward (via a hook on lm_head)."""
    captured = []
    handle = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach().clone()))
    with torch.no_grad():
        model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros_like(ids), ttt_steps=steps)
    handle.remove()
    assert len(captured) == steps, f"expected {steps} lm_head calls, got {len(captured)}"
    return torch.cat(captured).float().numpy()


def speculators_load(case: dict, aux, ids) -> dict:
    from speculators import SpeculatorModel

    model = SpeculatorModel.from_pretrained(case["path"]).eval()
    out = {"logits": speculators_logits(model, aux, ids, case["steps"]), "class": type(model).__name__}
    if model.d2t is not None:
        out.update(d2t=model.d2t.numpy(), t2d=model.t2d.numpy())
    out["target_layer_ids"] = np.asarray(model.target_layer_ids)
    return out


def speculators_create(case: dict, aux, ids) -> dict:
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    spec = dict(case["config"])
    layer = layer_config(dict(spec.pop("transformer_layer_config")))
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, **spec,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=case["steps"])],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))
    model = Eagle3DraftModel(config).eval()
    randomize_(model, case["seed"])
    t2d, d2t = vocab_maps(layer.vocab_size, config.draft_vocab_size, case["seed"])
    model.load_vocab_mappings(t2d, d2t)
    model.save_pretrained(case["path"])
    return {"logits": speculators_logits(model, aux, ids, case["steps"]), "d2t": d2t.numpy(), "t2d": t2d.numpy(),
            "embed": model.embed_tokens.weight.detach().numpy()}


# ------------------------------------------------------------------------------------------ SpecForge


def specforge_logits(model, aux: torch.Tensor, ids: torch.Tensor, steps: int) -> np.ndarray:
    """SpecForge's training-time test (its Eagle3 trainer's loop, sdpa backend) through the draft's
    public methods: project once, then per step embed the ids shifted by the step, run the
    backbone with the shared cache, feed its output back, and compute the logits."""
    seq = ids.shape[1]
    with torch.no_grad():
        hidden = model.project_hidden_states(aux)
        mask = model.prepare_decoder_attention_mask(torch.ones(1, seq, dtype=torch.bool), hidden, 1, seq, 0)
        positions = torch.arange(seq).unsqueeze(0)
        cache = [[], []]
        out = []
        for step in range(steps):
            step_ids = torch.cat([ids[:, step:], ids.new_zeros(1, step)], dim=1)
            hidden = model.backbone(input_embeds=model.embed_input_ids(step_ids).to(hidden.dtype),
                                    hidden_states=hidden, cache_hidden=cache, attention_mask=mask,
                                    position_ids=positions)
            out.append(model.compute_logits(hidden))
    return torch.cat(out).float().numpy()


def specforge_load(case: dict, aux, ids) -> dict:
    from transformers import LlamaConfig

    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.training.model_loading import warm_start_draft_model

    config = LlamaConfig.from_pretrained(case["path"])
    model = LlamaForCausalLMEagle3(config).float().eval()
    report = warm_start_draft_model(model, case["path"], draft_config=config, strategy="none")
    assert report.loaded_embedding, "the checkpoint was expected to carry the embedding"
    return {"logits": specforge_logits(model, aux, ids, case["steps"]), "d2t": model.d2t.numpy(),
            "t2d": model.t2d.numpy()}


def specforge_create(case: dict, aux, ids) -> dict:
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    config = layer_config(dict(case["config"]))
    model = LlamaForCausalLMEagle3(config).float().eval()
    randomize_(model, case["seed"])
    t2d, d2t = vocab_maps(config.vocab_size, config.draft_vocab_size, case["seed"])
    with torch.no_grad():
        model.t2d.copy_(t2d)
        model.d2t.copy_(d2t)
    model.save_pretrained(case["path"])
    return {"logits": specforge_logits(model, aux, ids, case["steps"]), "d2t": d2t.numpy(), "t2d": t2d.numpy(),
            "embed": model.embed_tokens.weight.detach().numpy()}


KINDS = {"speculators_load": speculators_load, "speculators_create": speculators_create,
         "specforge_load": specforge_load, "specforge_create": specforge_create}


def main(jobs_file: str) -> None:
    torch.manual_seed(0)
    with open(jobs_file) as f:
        cases = json.load(f)["cases"]
    for case in cases:
        inputs = np.load(case["inputs"])
        aux, ids = torch.from_numpy(inputs["aux"]), torch.from_numpy(inputs["ids"])
        result = KINDS[case["kind"]](case, aux, ids)
        np.savez(case["out"], **result)
        print(f"{case['kind']} {case['path']}: ok")


if __name__ == "__main__":
    main(sys.argv[1])
