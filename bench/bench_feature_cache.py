"""Offline draft training from the feature cache against online training, on a real target.

    python -m bench.bench_feature_cache [--model smollm2-135m-instruct] [--conversations 64] [--steps 8]

Both train the same ELSI m=1 draft (h_18 for SmolLM2, `--layers`) with the same seed, batches and
recipe (`--init target`, draft vocabulary 8192, 3 training-time-test steps) on the first
`--conversations` of the draft experiment's regenerated training subset
(runs/draft-experiment/<model>/train-subset, `python -m bench.draft_experiment --stages data`): online runs
the target's forward for every batch, offline reads the states from a cache built once for the
layers (its build time is reported on its own: it is paid once for every layer set that trains from
it). Timed alternately, `--reps` times each, medians of training tokens (answer tokens in the loss)
per second. The loss curves must agree (the cache is bfloat16 here, as the experiment's).
  -> bench/results/feature_cache_cpu.jsonl (target of the issue: offline >= 3x online tokens/s)

    python -m bench.bench_feature_cache --dump [--data runs/data-smollm2] [--layers 11]

times the dump itself, as the long run makes it (bf16 target where the CPU multiplies bf16, a
bfloat16 cache): the layers and the final state (soft labels) against the layers only (labels from
the answers, the forward stopped at the deepest layer), alternately `--reps` times on the same
`--conversations` of the data, medians of dumped tokens (prompt and answer) per second. The two
must hold the same layer states bit for bit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from bench.common import device_name, record
from elsi_fast.targets.loading import load_model
from elsi_fast.training.feature_cache import build, open_cache
from elsi_fast.training.regenerate import CONVERSATIONS_FILE, read_conversations
from elsi_fast.training.train import train_draft
from elsi_fast.training.training_data import conversation_samples

RECIPE = dict(init="target", draft_vocab_size=8192, ttt_steps=3, batch_size=8, lr=3e-3, warmup=2, seq_len=512)


def _train(model, tokenizer, layers, samples, out: Path, steps: int, cache=None) -> tuple[float, list[float], int]:
    """(training tokens / s of the steps, loss curve, tokens in the loss) of one run from scratch; the
    draft's set-up (warm start, vocabulary) is the same for both and not counted."""
    _, summary = train_draft(model, tokenizer, layers, samples, out_dir=out, steps=steps, feature_cache=cache,
                             resume=False, progress=False, save_every=10**6, **RECIPE)
    history = summary["history"]
    return summary["tokens_per_second_this_run"], [h["loss"] for h in history], sum(h["tokens"] for h in history)


def dump_speed(args) -> None:
    import torch

    from elsi_fast.training.train import training_precision

    dtype = "bfloat16" if training_precision("auto", torch.device("cpu")) == "bfloat16" else "float32"
    model, tokenizer = load_model(args.model, device="cpu", dtype=dtype)
    records = read_conversations(Path(args.data) / CONVERSATIONS_FILE)[: args.conversations]
    samples = conversation_samples(records, tokenizer, RECIPE["seq_len"], model.config.vocab_size)
    tokens = sum(len(s.ids) for s in samples)
    seconds: dict[str, list[float]] = {"layers and final state": [], "layers only": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):  # alternated, so that drifting machine speed hits both alike
            for mode in seconds:
                start = time.perf_counter()
                build(model, samples, args.layers, Path(tmp) / f"{rep}-{mode}", dtype="bfloat16",
                      final=mode == "layers and final state", progress=False)
                seconds[mode].append(time.perf_counter() - start)
        full, layers_only = (open_cache(Path(tmp) / f"0-{mode}") for mode in seconds)
        same = torch.equal(full.batch(samples, range(len(samples)), args.layers)[3],
                           layers_only.batch(samples, range(len(samples)), args.layers)[3])
    speed = {mode: tokens / statistics.median(s) for mode, s in seconds.items()}
    params = {"model": args.model, "target_dtype": dtype, "layers": args.layers, "conversations": len(samples),
              "tokens": tokens, "reps": args.reps, "threads": torch.get_num_threads(), "cache_dtype": "bfloat16",
              "seconds": seconds, "same_layer_states": same, "loadavg": os.getloadavg(), "note": args.note}
    record("feature_cache_cpu", "feature_cache_dump", "dump_tokens_per_s/layers-only", speed["layers only"],
           "tokens/s", device=device_name("cpu"), baseline=speed["layers and final state"],
           ratio=speed["layers only"] / speed["layers and final state"], params=params)
    print(f"{args.model} layers {args.layers}, {tokens} tokens: layers and final state "
          f"{speed['layers and final state']:.0f} tokens/s, layers only {speed['layers only']:.0f} tokens/s "
          f"({speed['layers only'] / speed['layers and final state']:.2f}x); same states: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--layers", type=int, nargs="+", default=[18])
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dump", action="store_true", help="time the dump: full cache against layers only")
    parser.add_argument("--data", default=str(ROOT / "runs" / "data-smollm2"), help="--dump: a regenerate folder")
    parser.add_argument("--note", default="", help="--dump: conditions to record in the row")
    args = parser.parse_args()
    from elsi_fast._infra.threads import configure

    configure(args.threads)
    if args.dump:
        return dump_speed(args)
    import torch

    data = ROOT / "runs" / "draft-experiment" / args.model / "train-subset" / CONVERSATIONS_FILE
    if not data.is_file():
        raise SystemExit(f"--model: no regenerated conversations at {data} "
                         "(python -m bench.draft_experiment --stages data)")
    model, tokenizer = load_model(args.model, device="cpu", dtype="float32")
    records = read_conversations(data)[: args.conversations]
    samples = conversation_samples(records, tokenizer, RECIPE["seq_len"], model.config.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        start = time.perf_counter()
        cache = build(model, samples, args.layers, work / "cache", dtype="bfloat16", progress=False)
        build_seconds = time.perf_counter() - start
        runs = {"online": [], "offline": []}
        for rep in range(args.reps):  # alternated, so that drifting machine speed hits both alike
            for mode in ("online", "offline"):
                runs[mode].append(_train(model, tokenizer, args.layers, samples, work / f"{mode}{rep}", args.steps,
                                         cache if mode == "offline" else None))
    tokens = runs["online"][0][2]
    speed = {mode: statistics.median(r[0] for r in rs) for mode, rs in runs.items()}
    curves = {mode: rs[0][1] for mode, rs in runs.items()}
    loss_gap = max(abs(a - b) / abs(a) for a, b in zip(curves["online"], curves["offline"]))
    params = {"model": args.model, "layers": args.layers, "conversations": len(samples), "steps": args.steps,
              "reps": args.reps, "threads": torch.get_num_threads(), "tokens_in_loss": tokens, "recipe": RECIPE,
              "cache_dtype": "bfloat16", "cache_build_s": build_seconds, "cache_bytes": cache.nbytes,
              "tokens_per_s": {mode: [r[0] for r in rs] for mode, rs in runs.items()}, "loss_curves": curves,
              "max_relative_loss_gap": loss_gap, "loadavg": os.getloadavg(), "target": "offline >= 3x online"}
    record("feature_cache_cpu", "draft_training_offline", "training_tokens_per_s/offline", speed["offline"],
           "tokens/s", device=device_name("cpu"), baseline=speed["online"], ratio=speed["offline"] / speed["online"],
           params=params)
    print(f"{args.model} layers {args.layers}: online {speed['online']:.0f} tokens/s, offline {speed['offline']:.0f} "
          f"tokens/s ({speed['offline'] / speed['online']:.2f}x); cache built in {build_seconds:.1f} s "
          f"({cache.nbytes / 2**20:.1f} MiB); largest relative loss gap {loss_gap:.2e}")


if __name__ == "__main__":
    main()
