"""Tiny random models of several architectures (4 blocks, vocabulary 64), shared by the capture,
analysis and report tests."""

import torch
from torch import nn
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GemmaConfig,
    GemmaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 64
_DECODER = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=VOCAB, max_position_embeddings=128, initializer_range=0.2,
)
TINY_MODELS = {
    "llama": (LlamaConfig, LlamaForCausalLM, _DECODER),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, _DECODER),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {**_DECODER, "head_dim": 8}),
    "mistral": (MistralConfig, MistralForCausalLM, _DECODER),
    "gemma": (GemmaConfig, GemmaForCausalLM, {**_DECODER, "head_dim": 8}),
    # soft-capped logits: analyze() must take the entropy from the model's own logits
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, {**_DECODER, "head_dim": 8, "final_logit_softcapping": 5.0}),
    "gpt_neox": (
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, vocab_size=VOCAB,
             max_position_embeddings=128, initializer_range=0.2),
    ),
    "gpt2": (
        GPT2Config,
        GPT2LMHeadModel,
        dict(n_embd=32, n_layer=4, n_head=4, vocab_size=VOCAB, n_positions=128, bos_token_id=1, eos_token_id=2,
             initializer_range=0.2),
    ),
}


def tiny_model(arch: str, seed: int = 0, **overrides) -> nn.Module:
    config_cls, model_cls, kwargs = TINY_MODELS[arch]
    torch.manual_seed(seed)
    config = config_cls(**{**kwargs, **overrides})
    config._attn_implementation = "eager"
    return model_cls(config).eval()


def _final_norm(model):
    for path in ("model.norm", "gpt_neox.final_layer_norm", "transformer.ln_f"):
        module = model
        for name in path.split("."):
            module = getattr(module, name, None)
        if module is not None:
            return module
    raise AssertionError("no final norm")
