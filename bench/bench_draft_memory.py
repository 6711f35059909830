"""Memory of m=1 vs m=3 EAGLE3 drafts: weight bytes, and the target-side capture buffer per token.

Counted on `Eagle3Draft` built on the meta device (no allocation), at the draft shapes of
Llama-3.1-8B and Qwen3-4B targets. Writes bench/results/draft_memory.jsonl; each m=1 row has the
m=3 value as baseline and ratio = m1 / m3.

    .venv/bin/python -m bench.bench_draft_memory
"""

from __future__ import annotations

import torch

from bench.common import record
from elsi_fast.draft import Eagle3Config, Eagle3Draft
from elsi_fast.engines.layer_ids import eagle3_default_layers

RESULTS = "draft_memory"
TARGETS = {
    "Llama-3.1-8B": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         intermediate_size=14336, vocab_size=128256, draft_vocab_size=32000, num_layers=32),
    "Qwen3-4B": dict(hidden_size=2560, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     intermediate_size=9728, vocab_size=151936, draft_vocab_size=32000, num_layers=36),
}
SERVING_DTYPE = torch.bfloat16


def draft_memory(shape: dict, m: int) -> dict[str, int]:
    """Parameter count and byte figures of one draft (weights in SERVING_DTYPE)."""
    n = shape["num_layers"]
    layers = tuple(eagle3_default_layers(n)) if m == 3 else (n // 2,)
    config = Eagle3Config(**{k: v for k, v in shape.items() if k != "num_layers"}, aux_layer_ids=layers)
    with torch.device("meta"):
        draft = Eagle3Draft(config).to(SERVING_DTYPE)
    element = torch.finfo(SERVING_DTYPE).bits // 8
    params = sum(p.numel() for p in draft.parameters())
    return {
        "trainable_params": params,
        "weight_bytes": params * element,
        "fc_weight_bytes": draft.fc.weight.numel() * element,
        "vocab_map_bytes": sum(b.numel() * b.element_size() for b in draft.buffers()),
        # what the target must capture and hand over per token: m hidden states of width d_t
        "capture_bytes_per_token": m * config.target_hidden_size * element,
        # the draft's own KV cache, for scale: independent of m
        "draft_kv_bytes_per_token": 2 * config.num_key_value_heads * config.head_dim * element,
    }


def main() -> None:
    device = "meta (analytic count)"
    print(f"{'target':14} {'metric':26} {'m=3':>14} {'m=1':>14} {'m1/m3':>7}")
    for target, shape in TARGETS.items():
        three, one = draft_memory(shape, 3), draft_memory(shape, 1)
        for metric, unit in (("trainable_params", "params"), ("weight_bytes", "bytes"), ("fc_weight_bytes", "bytes"),
                             ("vocab_map_bytes", "bytes"), ("capture_bytes_per_token", "bytes"),
                             ("draft_kv_bytes_per_token", "bytes")):
            params = {"target": target, "dtype": str(SERVING_DTYPE).removeprefix("torch."),
                      **shape}
            record(RESULTS, "draft_memory", metric, three[metric], unit, device=device, params={**params, "m": 3})
            ratio = one[metric] / three[metric]
            record(RESULTS, "draft_memory", metric, one[metric], unit, device=device, baseline=three[metric],
                   ratio=ratio, params={**params, "m": 1})
            print(f"{target:14} {metric:26} {three[metric]:>14,} {one[metric]:>14,} {ratio:>7.3f}")


if __name__ == "__main__":
    main()
