"""`elsi-fast eval-draft --replay`: tau from the target's cached continuations and states, no target forward.

Greedy speculative decoding emits the target's greedy continuation whatever the draft proposes,
so a draft's rounds follow from that continuation and the target's states along it
(`elsi_fast.decoding.evaluation`, docs/experiments.md). A replay folder holds, once per target and
prompt set:
- `conversations.jsonl` and `regenerate.json` of `elsi-fast regenerate` at temperature 0: each
  record's `prompt_ids`, `response_ids` (the target's greedy tokens, its stop token included when
  it stopped) and `stop`;
- `states/` (or --states): a feature cache of prompt + continuation of every record
  (`training.feature_cache`, `meta.json` and flat arrays), complete, dumped from this target, holding
  the draft's layers. `--cache-layers` dumps it when absent: the only target forward.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from . import UsageError, one_line
from .regenerate import CONVERSATIONS_FILE

SETTINGS_FILE = "regenerate.json"  # elsi_fast.training.regenerate.SETTINGS_FILE (no torch import here)
STATES_FOLDER = "states"
META_FILE = "meta.json"  # elsi_fast.training.feature_cache.META_FILE
# Options of live decoding only (--prompts itself is exclusive with --replay in the parser).
LIVE_ONLY = {"target_runtime": "--target-runtime", "max_new_tokens": "--max-new-tokens",
             "max_prompt_tokens": "--max-prompt-tokens", "ignore_eos": "--ignore-eos"}
REPLAY_ONLY = {"states": "--states", "cache_layers": "--cache-layers"}


def _fail(message: str) -> None:
    raise UsageError(message)


def read_replay_records(path: str, option: str = "--replay") -> tuple[str, list[dict]]:
    """The replay folder `path` names (a folder, or its conversations.jsonl) and its records,
    checked: greedy settings, every line a record with prompt ids, response ids and stop. Errors
    name `option`."""
    folder = (os.path.dirname(path) or ".") if os.path.basename(os.path.normpath(path)) == CONVERSATIONS_FILE else path
    if not os.path.exists(path):
        _fail(f"{option}: no such file or folder: {path}; give a folder of `elsi-fast regenerate` (greedy)")
    if os.path.isfile(folder):
        _fail(f"{option}: {path} is a file; give a regenerate folder or its {CONVERSATIONS_FILE} (kept answers, an "
              "export_answers .json, are rebuilt into one by `elsi-fast regenerate --restore`)")
    conversations, settings = os.path.join(folder, CONVERSATIONS_FILE), os.path.join(folder, SETTINGS_FILE)
    for needed in (conversations, settings):
        if not os.path.isfile(needed):
            _fail(f"{option}: {folder} has no {os.path.basename(needed)}; give a folder of `elsi-fast regenerate`")
    try:
        temperature = json.loads(Path(settings).read_text()).get("temperature")
    except (json.JSONDecodeError, AttributeError):
        _fail(f"{option}: {settings} is not a regenerate settings file")
    if temperature != 0:
        _fail(f"{option}: its answers were sampled at temperature {temperature}; a replay needs the target's greedy "
              "continuations (regenerate --temperature 0)")
    records = []
    with open(conversations) as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                _fail(f"{option}: line {number} of {conversations} is not JSON (cut by a crash? rerun regenerate)")
            ids = [record.get("prompt_ids"), record.get("response_ids")] if isinstance(record, dict) else [None]
            if any(not isinstance(v, list) or not all(isinstance(t, int) and t >= 0 for t in v) for v in ids) \
                    or not ids[0] or record.get("stop") not in ("eos", "length"):
                _fail(f"{option}: line {number} of {conversations} is not a regenerate record (prompt_ids, "
                      "response_ids, stop)")
            records.append(record)
    if not records:
        _fail(f"{option}: {conversations} holds no continuations")
    return folder, records


def _check_cache_layers(cache_layers: list[int], layers: list[int]) -> None:
    missing = sorted(set(layers) - set(cache_layers))
    if missing:
        _fail(f"--cache-layers: must include the draft's layers {layers}; {missing} missing")


def check_replay(args: argparse.Namespace) -> None:
    """eval-draft's checks in replay mode (no torch): the folder, its records, the states."""
    for name, option in LIVE_ONLY.items():
        if getattr(args, name) is not None:
            _fail(f"{option}: a replay evaluates the cached continuations of --replay; drop {option}")
    if args.cache_layers is not None:
        if any(layer < 0 for layer in args.cache_layers):
            _fail(f"--cache-layers: input-to-layer ids are >= 0 (0 = embeddings), got {args.cache_layers}")
        try:  # an EAGLE3-format draft names its layers in config.json (a speculators one: checked once loaded)
            layers = json.loads(Path(args.draft, "config.json").read_text()).get("eagle_aux_hidden_state_layer_ids")
        except (json.JSONDecodeError, AttributeError):
            layers = None
        if isinstance(layers, list):
            _check_cache_layers(args.cache_layers, layers)
    args.replay_folder, args.replay_records = read_replay_records(args.replay)
    args.states = args.states or os.path.join(args.replay_folder, STATES_FOLDER)
    meta_path = os.path.join(args.states, META_FILE)
    if not os.path.isfile(meta_path):
        if args.cache_layers is None:
            _fail(f"--states: no target states at {args.states}; dump them once with --cache-layers L [L ...] (the "
                  "draft's layers or a superset; the only target forward)")
        return
    try:
        meta = json.loads(Path(meta_path).read_text())
        sequences, done = len(meta["lengths"]), meta["done"]
    except (json.JSONDecodeError, KeyError, TypeError):
        _fail(f"--states: {meta_path} is not a feature cache's meta.json")
    if sequences != len(args.replay_records):
        _fail(f"--states: {args.states} holds the states of {sequences} sequences, --replay has "
              f"{len(args.replay_records)} continuations")
    if done != sequences and args.cache_layers is None:
        _fail(f"--states: {args.states} is incomplete (its dump was interrupted); rerun with its --cache-layers "
              f"{' '.join(map(str, meta.get('layers', [])))} to finish it")


def replay_handler(args: argparse.Namespace) -> int:
    from ..decoding.evaluation import continuation_samples, pooled_tau, replay_runs
    from ..training.feature_cache import build, open_cache, target_fingerprint
    from .draft import load_target, print_tau_table, read_target_draft

    model, _ = load_target(args)
    draft = read_target_draft(args, model.get_input_embeddings().weight.detach(), device=model.device)
    layers, records = list(draft.config.aux_layer_ids), args.replay_records
    if args.cache_layers is not None:
        _check_cache_layers(args.cache_layers, layers)
    try:
        if args.cache_layers is not None:
            cache = build(model, continuation_samples(records), args.cache_layers, args.states,
                          dtype=args.cache_dtype, progress=not args.no_progress)
        else:
            cache = open_cache(args.states)
    except ValueError as exc:
        raise UsageError(f"--states: {one_line(exc).removeprefix('feature_cache: ')}") from None
    if cache.meta["target"] != target_fingerprint(model):
        _fail(f"--states: {args.states} was dumped from another target (or another --dtype); dump it again "
              "with --cache-layers into another folder")
    missing = sorted(set(layers) - set(cache.layers))
    if missing:
        _fail(f"--states: {args.states} holds layers {cache.layers}, not the draft's {missing}; dump a superset "
              "into another --states folder with --cache-layers")
    seen: dict[str, int] = {}
    only = []
    for index, record in enumerate(records):
        category = record.get("category") or "text"
        seen[category] = seen.get(category, 0) + 1
        if args.max_prompts is None or seen[category] <= args.max_prompts:
            only.append(index)
    # The batched chain replay runs the torch draft; an explicit native path or a sliding window
    # (whose window moves with each chain step) replays prompt by prompt on that path.
    batched = args.draft_dtype is None and args.draft_backend != "native" and draft.config.sliding_window is None
    try:
        runs = replay_runs(draft, records, cache, k=args.k, draft_dtype=args.draft_dtype,
                           draft_backend=args.draft_backend, batch_size=16 if batched else None, only=only,
                           progress=not args.no_progress, prompt_lookup=args.prompt_lookup, lookup_k=args.lookup_k)
    except ValueError as exc:
        text = one_line(exc)
        raise UsageError(f"--states: {text.removeprefix('cache: ')}" if text.startswith("cache:") else text) from None
    if not runs:
        _fail(f"--replay: no continuation of {args.replay_folder} has 2 or more new tokens (one verification round)")
    taus = pooled_tau(runs)
    backend = next(iter(runs.values()))[0].draft_backend
    from .draft import lookup_note

    print(f"draft layers {layers}, k={args.k}{lookup_note(args)}, replayed on {sum(map(len, runs.values()))} cached continuations "
          f"of {args.replay_folder} (no target forward); draft: {backend}")
    print_tau_table(taus, {category: len(results) for category, results in runs.items()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"draft": args.draft, "layers": layers, "k": args.k, "prompt_lookup": args.prompt_lookup,
                       "lookup_k": args.lookup_k,
                       "replay": args.replay_folder,
                       "states": args.states, "tau": taus, "draft_backend": backend}, f, indent=1)
    return 0
