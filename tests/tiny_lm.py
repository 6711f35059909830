"""A tiny trained-tokenizer Llama target with sharpened logits, shared by the training and evaluation tests."""

from __future__ import annotations

import random

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from elsi_fast.targets.toy_targets import train_tokenizer


def _texts() -> list[str]:
    rng = random.Random(0)
    subjects = ["the cat", "a dog", "my friend", "the old king", "a small bird"]
    verbs = ["sat on", "looked at", "ran to", "sang about", "dreamed of"]
    objects = ["the mat", "a river", "the castle", "green hills", "the moon"]
    return [" ".join(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}." for _ in range(40))
            for _ in range(12)]


TEXTS = _texts()
TOKENIZER = train_tokenizer(TEXTS, 320)


def _target():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(TOKENIZER), hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).eval()
    # A random model's next-token distribution is nearly uniform, leaving the draft nothing to
    # learn; sharper logits make it a peaked, context-dependent function like a trained model's.
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model


TARGET = _target()
SMALL = dict(draft_vocab_size=96, batch_size=4, seq_len=24, lr=3e-3, warmup=2, ttt_steps=2,
             draft_config={"intermediate_size": 24, "num_attention_heads": 2, "num_key_value_heads": 1},
             precision="float32", progress=False)  # the fp32 math on every CPU (bf16: test_train.py)


def conversation_samples_of_tiny_target(tmp_dir, count: int = 12, max_new_tokens: int = 12):
    """The tiny target's own answers to `count` prompts (elsi_fast.training.regenerate), as training samples."""
    from elsi_fast.analysis.prompts import Prompt
    from elsi_fast.training.regenerate import CONVERSATIONS_FILE, read_conversations, regenerate
    from elsi_fast.training.training_data import conversation_samples

    prompts = [Prompt(text=TEXTS[i % len(TEXTS)][: 15 + 7 * i], id=str(i), chat=True) for i in range(count)]
    regenerate(TARGET, TOKENIZER, prompts, tmp_dir, max_new_tokens=max_new_tokens, batch_size=4, progress=False)
    records = read_conversations(f"{tmp_dir}/{CONVERSATIONS_FILE}")
    return conversation_samples(records, TOKENIZER, 64, TARGET.config.vocab_size)
