"""A long, resumable draft training run on the target's own conversations, with a tau curve.

    python -m bench.draft_long_run [--model smollm2-135m-instruct] [--set elsi-m1] [--steps 1000]
                                   [--stages cache train curve]

Data: the `elsi-fast regenerate --self-instruct` folder `--data` (the target's instructions and
greedy answers). 200 of its conversations (chosen by a seeded shuffle) are held out: never trained
on, they measure tau on unseen instructions of the training distribution; 200 of the training ones
measure it held-in. The third set is the 480 Spec-Bench prompts with the target's greedy 128-token
continuations, restored from the draft experiment's kept answers (the same continuations
`eval-draft --max-new-tokens 128` generates, so the replayed tau is the live one; docs/method.md).
"held-out-128" is the held-out set cut to its answers' first 128 tokens, Spec-Bench's length: tau
grows along an answer, so it separates the prompts' share of the Spec-Bench gap from the length's.
"held-out-openings": 200 conversations whose user turns were sampled after a task opening
(`regenerate --instruction-openings`), held out once the data first has 400 such: how the drafts
fare on the kinds of task Spec-Bench asks for, in the target's own words.
`--labels answers` trains on the answers' own next tokens (the target's greedy ones) instead of
the target's distribution: its cache holds the layers only, dumped up to the deepest one.
`--conversations N` trains on the first N training conversations only (a cell whose layers cost a
new feature cache, e.g. the m=3 sets, on a budget; a complete longer cache of the layers serves them).
`--repeat CATEGORY K` draws one category's conversations K times as often (e.g. the task prompts
of `bench.task_sources`, a few percent of the data). `--documents-only` trains on the long-document
tasks (`regenerate --corpus-documents`) alone, and
`--max-tokens` sets the training length (prompt and answer; 512 by default): a 600-token document
and its answer need about 850, as Spec-Bench's 512-token prompts and their answers need 640.

Stages, each resumable:
- cache: one bfloat16 feature cache of the training conversations for the layer set, and one per
  evaluation set (`elsi_fast.training.feature_cache`);
- train: `train_draft` from the cache, its drafts kept at log-spaced steps (`keep_steps`);
- curve: every kept draft replayed on the three sets (k = 1..5), one row per (step, set) in
  bench/results/draft_long_run_cpu.jsonl (rows already there are skipped), and the plot
  docs/img/<model>_long_run_tau.png.
Work goes to runs/long-run/<model>/; Ctrl-C stops at the end of a step and a rerun continues.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

from bench.common import device_name, record, shared_data

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "draft_long_run_cpu"
KEEP = ROOT / "bench" / "results" / "draft_experiment"  # sets.json and eval.answers.json per model
MAX_TOKENS = 512  # the default training length of a conversation (prompt end and answer)
HELD = 200  # conversations in each of the held-in and held-out sets
SPEC_BENCH_TOKENS = 128  # the Spec-Bench continuations' length, which held-out-128 cuts answers to
CURVE_SETS = ("held-in", "held-out", "held-out-128", "spec-bench", "held-out-openings")
KS = (1, 2, 3, 4, 5)
RECIPE = {"init": "random", "draft_vocab_size": 4096, "ttt_steps": 3, "batch_size": 16, "lr": 3e-3}
DRAFT_SHAPE = ("intermediate_size", "num_key_value_heads")  # recipe keys that are draft config fields


def split(records: list[dict], seed: int = 0) -> tuple[list[dict], list[dict], list[dict]]:
    """(training, held-in, held-out) conversations: HELD held out by a seeded shuffle, HELD of the rest."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    held_out = sorted(order[:HELD])
    train = [records[i] for i in sorted(order[HELD:])]
    held_in = [train[i] for i in sorted(random.Random(seed + 1).sample(range(len(train)), HELD))]
    return train, held_in, [records[i] for i in held_out]


def opening_batch_ids(records: list[dict], data: Path) -> list[str]:
    """Ids of the conversations whose user turn was sampled after a task opening (`regenerate
    --instruction-openings`: self_instruct.json names the first such batch; ids are si-<seed>-<batch>-<j>)."""
    settings = data / "self_instruct.json"
    openings = json.loads(settings.read_text()).get("openings") if settings.is_file() else None
    if openings is None:
        return []
    return [r["id"] for r in records if r["id"].startswith("si-") and int(r["id"].split("-")[2]) >= openings["from_batch"]]


def held_sets(records: list[dict], keep: Path, seed: int = 0,
              opening_ids: list[str] | None = None) -> tuple[list[dict], list[dict], list[dict]]:
    """`split`, fixed at the run's first data: the held sets' ids are kept in the repository
    (keep/long-run-split-seedN.json), so conversations appended to the data later (a longer
    `regenerate` run) all go to training and a continued run, on this machine or a fresh clone, is
    measured on the same unseen conversations."""
    path = keep / f"long-run-split-seed{seed}.json"
    if not path.is_file():
        _, held_in, held_out = split(records, seed)
        path.write_text(json.dumps({"held-in": [r["id"] for r in held_in], "held-out": [r["id"] for r in held_out]}))
    ids = json.loads(path.read_text())
    held = set(ids["held-in"]) | set(ids["held-out"])
    candidates = [i for i in opening_ids or () if i not in held]
    if "held-out-openings" not in ids and len(candidates) >= 2 * HELD:
        # The first data sampled after task openings (opening_ids, in data order): HELD of them held
        # out for good, fixed the first time there are twice as many, so cells trained later on
        # opening data are measured on unseen ones.
        ids["held-out-openings"] = sorted(random.Random(seed + 2).sample(candidates, HELD))
        path.write_text(json.dumps(ids))
    by_id = {r["id"]: r for r in records}
    held = ids["held-in"] + ids["held-out"] + ids.get("held-out-openings", [])
    missing = [i for i in held if i not in by_id]
    if missing:
        raise SystemExit(f"--data: {len(missing)} conversations of {path} are not in the data (first {missing[0]})")
    out = set(ids["held-out"]) | set(ids.get("held-out-openings", []))
    return ([r for r in records if r["id"] not in out], [by_id[i] for i in ids["held-in"]],
            [by_id[i] for i in ids["held-out"]])


def repeated(train: list[dict], repeats: dict[str, int]) -> list[dict]:
    """`train` with K - 1 more copies of each conversation of a category that `repeats` maps to K,
    appended in order: the feature cache of `train` alone is a prefix that the longer list grows
    from, and the sampler draws a repeated conversation K times as often."""
    out = list(train)
    for category, times in repeats.items():
        chosen = [r for r in train if r.get("category") == category]
        if not chosen:
            raise ValueError(f"no training conversations of category {category!r}")
        out += chosen * (times - 1)
    return out


def held_out_openings(records: list[dict], keep: Path, seed: int = 0) -> list[dict]:
    """The held-out conversations sampled after task openings (`held_sets`), or none yet."""
    ids = json.loads((keep / f"long-run-split-seed{seed}.json").read_text()).get("held-out-openings", [])
    by_id = {r["id"]: r for r in records}
    return [by_id[i] for i in ids]


def keep_steps(steps: int, points: int = 8) -> list[int]:
    """About `points` log-spaced steps up to `steps` (the last one included)."""
    first = max(1, steps // 2 ** (points - 1))
    return sorted({min(steps, round(first * (steps / first) ** (i / (points - 1)))) for i in range(points)})


def continued_cell_name(parent_name: str, suffix: str, limit: int = 200) -> str:
    """parent_name + suffix; past `limit` characters (a file name may hold 255) the parent's name
    keeps its first steps and a hash of the whole, so a chain of continuations stays unique."""
    name = parent_name + suffix
    if len(name) <= limit:
        return name
    digest = hashlib.sha1(parent_name.encode()).hexdigest()[:10]
    return f"{parent_name[: max(0, limit - len(suffix) - 12)]}~{digest}" + suffix


def continued_from(init_from: str, work: Path) -> tuple[Path, int, int, str]:
    """(draft folder, tokens seen, steps, cell name) of what --init-from names: a finished cell of
    `work` (its train summary counts its own parents), or a kept draft folder, whose training.json
    (bench/keep_draft.py) holds the same counts and the cell it came from."""
    from elsi_fast.training.train import SUMMARY_FILE

    cell, kept = work / init_from, Path(init_from) / "training.json"
    if (cell / SUMMARY_FILE).is_file():
        summary = json.loads((cell / SUMMARY_FILE).read_text())
        return (cell, summary.get("parent_tokens", 0) + sum(h["tokens"] for h in summary["history"]),
                summary.get("parent_steps", 0) + summary["history"][-1]["step"], init_from)
    if kept.is_file():
        facts = json.loads(kept.read_text())
        return Path(init_from), facts["tokens_seen"], facts["steps"], Path(facts["source"]).name
    raise SystemExit(f"--init-from: {init_from} is neither a finished cell of {work} ({SUMMARY_FILE}) "
                     "nor a kept draft folder (training.json)")


def _spec_bench(model, tokenizer, work: Path, keep: Path) -> list[dict]:
    from elsi_fast.analysis.prompts import load_prompts
    from elsi_fast.training.regenerate import CONVERSATIONS_FILE, read_conversations, restore_answers

    folder = work / "spec-bench"
    if not (folder / CONVERSATIONS_FILE).is_file():
        prompts = load_prompts(str(shared_data("prompts", "spec_bench_question.jsonl")))
        exported = json.loads((keep / "eval.answers.json").read_text())
        restore_answers(model, tokenizer, prompts, folder, exported, max_new_tokens=128, max_prompt_tokens=512)
    return read_conversations(folder / CONVERSATIONS_FILE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--data", default=str(ROOT / "runs" / "data-smollm2"))
    parser.add_argument("--set", default="elsi-m1", help="a layer set of the draft experiment's sets.json")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-from", default=None, metavar="CELL",
                        help="continue a finished cell of this run, or a kept draft folder (bench/results/drafts/...; "
                        "a fresh clone has no cells), from its final draft with a fresh schedule of --steps; the new "
                        "cell is CELL+STEPS (a kept draft: its source cell's name) and its curve counts CELL's tokens")
    parser.add_argument("--lr", type=float, default=RECIPE["lr"],
                        help=f"peak learning rate (default {RECIPE['lr']:g}); another one names the cell <cell>-lr<LR>")
    parser.add_argument("--draft-vocab-size", type=int, default=RECIPE["draft_vocab_size"],
                        help=f"(default {RECIPE['draft_vocab_size']}); with --init-from a larger one grows the parent's "
                        "vocabulary; another one names the cell <cell>-v<SIZE>")
    parser.add_argument("--label-temperature", type=float, default=1.0, metavar="T",
                        help="the target's soft labels at temperature T (default 1: its distribution; below 1 "
                        "sharper); another one names the cell <cell>-lt<T>")
    parser.add_argument("--labels", choices=("target", "answers"), default="target",
                        help="target: the target's distribution (default); answers: each answer's next token, from a "
                        "cache of the layers only; names the cell <cell>-answers")
    parser.add_argument("--intermediate-size", type=int, default=None, metavar="N",
                        help="the draft's MLP width (default: the target's, EAGLE3's choice); names the cell <cell>-mlp<N>")
    parser.add_argument("--kv-heads", type=int, default=None, metavar="N",
                        help="the draft's key-value heads (default: the target's); with --init-from a multiple of "
                        "the parent's copies them, the same draft to start with; names the cell <cell>-kv<N>")
    parser.add_argument("--conversations", type=int, default=None, metavar="N",
                        help="train on the first N training conversations only; names the cell <cell>-c<N>")
    parser.add_argument("--openings-only", action="store_true",
                        help="train on the conversations sampled after task openings only; names the cell <cell>-openings")
    parser.add_argument("--documents-only", action="store_true",
                        help="train on the long-document tasks (ids cd-) only; names the cell <cell>-documents")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, metavar="N",
                        help=f"training length of a conversation, the end of its prompt and its answer (default "
                        f"{MAX_TOKENS}); names the cell <cell>-t<N>")
    parser.add_argument("--repeat", nargs=2, action="append", default=[], metavar=("CATEGORY", "K"),
                        help="draw the training conversations of CATEGORY (e.g. task-translation) K times as often "
                        "(K copies in the sampled list; repeatable); names the cell <cell>-r<CATEGORY><K>")
    parser.add_argument("--stages", nargs="+", default=["cache", "train", "curve"])
    parser.add_argument("--curve-sets", nargs="+", default=list(CURVE_SETS), choices=CURVE_SETS,
                        help="the evaluation sets the curve stage replays")
    parser.add_argument("--curve-steps", type=int, nargs="+", default=None,
                        help="only these kept steps (default: every kept one)")
    parser.add_argument("--curve-draft", default=None, metavar="KEPT",
                        help="the curve stage replays this kept draft folder (bench/results/drafts/...) instead of a "
                        "cell's checkpoints, its rows under its source cell and final step (e.g. a new evaluation set)")
    parser.add_argument("--note", default="", help="conditions to record in the rows (e.g. another job beside)")
    args = parser.parse_args()

    import torch

    from elsi_fast.decoding.evaluation import continuation_samples, pooled_tau, replay_runs_per_k
    from elsi_fast.draft import read_draft
    from elsi_fast.targets.loading import load_model
    from elsi_fast.training.feature_cache import build
    from elsi_fast.training.regenerate import CONVERSATIONS_FILE, read_conversations
    from elsi_fast.training.train import CHECKPOINTS_DIR, SUMMARY_FILE, train_draft, training_precision
    from elsi_fast.training.training_data import conversation_samples

    recipe = {**RECIPE, "lr": args.lr, "draft_vocab_size": args.draft_vocab_size}
    if args.intermediate_size is not None:
        if args.intermediate_size < 1:
            raise SystemExit(f"--intermediate-size: expected a positive width, got {args.intermediate_size}")
        recipe["intermediate_size"] = args.intermediate_size
    if args.kv_heads is not None:
        if args.kv_heads < 1:
            raise SystemExit(f"--kv-heads: expected a positive count, got {args.kv_heads}")
        recipe["num_key_value_heads"] = args.kv_heads
    if not 0 < args.label_temperature < float("inf"):
        raise SystemExit(f"--label-temperature: expected a finite number > 0, got {args.label_temperature}")
    if args.label_temperature != 1.0:
        if args.labels == "answers":
            raise SystemExit("--label-temperature: labels from the answers are one-hot; drop it or use --labels target")
        recipe["label_temperature"] = args.label_temperature
    if args.labels != "target":
        recipe["labels"] = args.labels
    if args.conversations is not None and args.conversations < 1:
        raise SystemExit(f"--conversations: expected a positive count, got {args.conversations}")
    if args.openings_only and args.documents_only:
        raise SystemExit("--documents-only: one selection of the data at a time (not with --openings-only)")
    if args.max_tokens < 2:
        raise SystemExit(f"--max-tokens: expected at least 2 (a prompt token and an answer token), got {args.max_tokens}")
    repeats = {}
    for category, times in args.repeat:
        if not times.isdigit() or int(times) < 2:
            raise SystemExit(f"--repeat: K must be an integer >= 2 (copies of {category}), got {times!r}")
        repeats[category] = int(times)
    selection = "-openings" if args.openings_only else "-documents" if args.documents_only else ""
    recipe_tag = ("" if args.lr == RECIPE["lr"] else f"-lr{args.lr:g}") + \
        ("" if args.draft_vocab_size == RECIPE["draft_vocab_size"] else f"-v{args.draft_vocab_size}") + \
        ("" if args.intermediate_size is None else f"-mlp{args.intermediate_size}") + \
        ("" if args.kv_heads is None else f"-kv{args.kv_heads}") + \
        ("" if args.label_temperature == 1.0 else f"-lt{args.label_temperature:g}") + \
        ("" if args.labels == "target" else f"-{args.labels}") + \
        ("" if args.conversations is None else f"-c{args.conversations}") + \
        ("" if args.max_tokens == MAX_TOKENS else f"-t{args.max_tokens}") + selection + \
        "".join(f"-r{category}{times}" for category, times in repeats.items())
    keep = KEEP / args.model
    layers = json.loads((keep / "sets.json").read_text())[args.set]
    work = ROOT / "runs" / "long-run" / args.model
    cell = work / f"{args.set}-seed{args.seed}-steps{args.steps}{recipe_tag}"
    parent_tokens = 0
    if args.init_from is not None:
        parent, parent_tokens, parent_steps, parent_name = continued_from(args.init_from, work)
        cell = work / continued_cell_name(parent_name, f"+{args.steps}{recipe_tag}")
    model, tokenizer = load_model(args.model, device="cpu", dtype="float32", argument="--model",
                                  device_argument="--device", progress=False)
    records = read_conversations(Path(args.data) / CONVERSATIONS_FILE)
    opening_ids = opening_batch_ids(records, Path(args.data))
    train, held_in, held_out = held_sets(records, keep, args.seed, opening_ids)
    if args.openings_only:
        opening = set(opening_ids)
        train = [r for r in train if r["id"] in opening]
        if not train:
            raise SystemExit(f"--openings-only: {args.data} holds no conversations sampled after task openings")
    if args.documents_only:
        train = [r for r in train if r["id"].startswith("cd-")]
        if not train:
            raise SystemExit(f"--documents-only: {args.data} holds no long-document tasks (regenerate --corpus-documents)")
    train = distinct = train[: args.conversations]
    try:
        train = repeated(train, repeats)
    except ValueError as exc:
        raise SystemExit(f"--repeat: {args.data}: {exc}") from None
    samples = conversation_samples(train, tokenizer, args.max_tokens, model.config.vocab_size)
    evaluation = {"held-in": held_in, "held-out": held_out,
                  "held-out-128": [{**r, "response_ids": list(r["response_ids"])[:SPEC_BENCH_TOKENS]} for r in held_out],
                  "spec-bench": _spec_bench(model, tokenizer, work, keep)}
    if openings := held_out_openings(records, keep, args.seed):
        evaluation["held-out-openings"] = openings
    caches = {}
    if "cache" in args.stages or "train" in args.stages:
        # The training states come from the target in bf16 where the CPU multiplies bf16 natively
        # (1.7x the fp32 forward; the cache holds bf16 either way); the evaluation sets' from the
        # fp32 target, which is what eval-draft decodes with.
        dumper = model
        if training_precision("auto", torch.device("cpu")) == "bfloat16":
            dumper = load_model(args.model, device="cpu", dtype="bfloat16", argument="--model",
                                device_argument="--device", progress=False)[0]
        # Labels from the answers need the layers only, in a folder of their own (one selection of
        # the data per folder: the opening conversations alone are not a prefix of all of them).
        # A new selection or length gets a folder of its own with either labels.
        folder = f"cache-train-{'-'.join(map(str, layers))}-{str(dumper.dtype).removeprefix('torch.')}" + \
            ("" if args.labels == "target" else "-layers" + ("-openings" if args.openings_only else "")) + \
            ("-documents" if args.documents_only else "") + \
            ("" if args.max_tokens == MAX_TOKENS else f"-t{args.max_tokens}")
        # Another selection's or length's cache already holds every conversation that comes out the same.
        caches["train"] = build(dumper, samples, layers, work / folder, dtype="bfloat16", max_bytes=40 * 2**30,
                                final=args.labels == "target", reuse=sorted(work.glob("cache-train-*")))
        del dumper
    kept_steps = keep_steps(args.steps)
    if "train" in args.stages:
        train_draft(model, tokenizer, layers, samples, out_dir=cell, feature_cache=caches["train"], steps=args.steps,
                    warmup=max(1, args.steps // 50), seq_len=args.max_tokens, seed=args.seed, save_every=25,
                    keep_steps=tuple(kept_steps), init_from=None if args.init_from is None else parent,
                    draft_config={k: v for k, v in recipe.items() if k in DRAFT_SHAPE},
                    **{k: v for k, v in recipe.items() if k not in DRAFT_SHAPE})
        # The data as trained on (the data folder may grow afterwards), and for a continued cell its
        # parent's tokens and steps, which its curve and kept facts count.
        summary = json.loads((cell / SUMMARY_FILE).read_text())
        summary.update(conversations=len(distinct), answer_tokens=sum(len(r["response_ids"]) for r in distinct),
                       **({"repeat": repeats} if repeats else {}))
        if args.init_from is not None:
            summary.update(parent_tokens=parent_tokens, parent_steps=parent_steps)
        (cell / SUMMARY_FILE).write_text(json.dumps(summary))
    if "curve" not in args.stages:
        return
    evaluation = {name: rows for name, rows in evaluation.items() if name in args.curve_sets}
    for name, rows in evaluation.items():
        caches[name] = build(model, continuation_samples(rows), layers, work / f"cache-{name}-{'-'.join(map(str, layers))}",
                             dtype="bfloat16", progress=False)
    summary_path = cell / SUMMARY_FILE
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    history = summary.get("history", [])
    trained_on = summary.get("conversations", len(distinct))  # the data may have grown since
    tokens_at = {h["step"]: parent_tokens + sum(x["tokens"] for x in history[: h["step"]]) for h in history}
    results = ROOT / "bench" / "results" / f"{RESULTS}.jsonl"
    earlier = [json.loads(line)["params"] for line in results.read_text().splitlines()] if results.is_file() else []
    done = {(p["cell"], p["step"], p["set"]) for p in earlier}
    facts = {"layers": layers, "recipe": recipe, "steps": args.steps, "init_from": args.init_from}
    # (cell, step, draft folder, tokens seen, conversations trained on) of each draft to replay
    replays = [(cell.name, step, cell / CHECKPOINTS_DIR / f"step-{step:06d}", tokens_at.get(step), trained_on)
               for step in args.curve_steps or kept_steps]
    if args.curve_draft is not None:
        kept = json.loads((Path(args.curve_draft) / "training.json").read_text())
        source = Path(kept["source"]).name
        rows_of_source = [p for p in earlier if p["cell"] == source]
        if kept["layers"] != layers or not rows_of_source:
            raise SystemExit(f"--curve-draft: {args.curve_draft} reads layers {kept['layers']} (--set {args.set}: "
                             f"{layers}) or its cell {source} has no curve rows to continue")
        last = max(rows_of_source, key=lambda p: p["step"])  # the kept step: the cell's final one
        facts = {key: last[key] for key in facts}
        replays = [(source, last["step"], Path(args.curve_draft), kept["tokens_seen"], kept["conversations"])]
    embed = model.get_input_embeddings().weight.detach()
    device = device_name("cpu")
    for cell_name, step, folder, seen, conversations in replays:
        if not folder.is_dir():
            continue
        draft = read_draft(folder, embed).eval()
        for name, rows in evaluation.items():
            if (cell_name, step, name) in done:
                continue
            with torch.inference_mode():
                runs = replay_runs_per_k(draft, rows, caches[name], KS, batch_size=16)
            for k in KS:
                tau = pooled_tau(runs[k])
                if k == 4:
                    print(f"step {step} ({seen or 0} tokens) {name}: tau(k=4) {tau['all']:.3f}")
                record(RESULTS, "draft_long_run", f"tau_k{k}", tau["all"], "tokens/forward", device=device,
                       params={"model": args.model, "cell": cell_name, "set": name, **facts, "step": step,
                               "tokens_seen": seen, "conversations": conversations,
                               "prompts": sum(len(v) for v in runs[k].values()), "per_category": tau,
                               "note": args.note, "pooled": True})
    _plot(results, args.model)


def _plot(results: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in results.read_text().splitlines()]
    rows = [r for r in rows if r["metric"] == "tau_k4" and r["params"]["model"] == model and r["params"]["tokens_seen"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    # One line per run and set: a continued cell (`<parent>+<steps>...`) extends its first cell's
    # line, since its tokens seen count the parent's; the sets by colour, the runs by marker.
    runs = sorted({r["params"]["cell"].split("+")[0] for r in rows})
    for run, marker in zip(runs, "osD^v<>"):
        for name, colour in (("held-in", "tab:blue"), ("held-out", "tab:orange"), ("held-out-128", "tab:green"),
                             ("spec-bench", "tab:red")):
            points = sorted((r["params"]["tokens_seen"], r["value"]) for r in rows
                            if r["params"]["cell"].split("+")[0] == run and r["params"]["set"] == name)
            if points:
                ax.plot(*zip(*points), "-" if marker == "o" else "--", color=colour, marker=marker, markersize=4,
                        label=f"{run}: {name}")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens seen")
    ax.set_ylabel("tau at k=4 (tokens per target forward)")
    ax.set_title(f"{model}: tau against training tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="upper left")
    out = ROOT / "docs" / "img" / f"{model.split('-')[0]}_long_run_tau.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


if __name__ == "__main__":
    main()
