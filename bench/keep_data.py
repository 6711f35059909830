"""Keep a `regenerate` folder in the repository compactly, and rebuild it on a fresh clone.

    .venv/bin/python -m bench.keep_data keep runs/data-smollm2 --target smollm2-135m-instruct
    .venv/bin/python -m bench.keep_data restore runs/data-smollm2 --target smollm2-135m-instruct \
        --prompts ../shared/data/prompts/train_instructions.jsonl \
        bench/results/data/smollm2-135m-instruct/task_prompts/{translation,summarization}.jsonl \
        --max-new-tokens 256

`keep` writes bench/results/data/<target>/: `answers.json.gz` (`export_answers`: ids and token
ids, no prompt text, with the regenerate settings) and, for a `--self-instruct` folder,
`self_instruct.json` (the sampling settings), `instructions_raw.jsonl.gz` (every sampled user
turn: ids, text, finished; the filter is a function of this file) and `instructions.jsonl.gz`
(the kept ones), and for a `--corpus-tasks` / `--corpus-documents` / `--corpus-copies` folder the
recipe of its document tasks, `corpus_tasks.json` / `corpus_documents.json` / `corpus_copies.json` (the corpora and evaluation prompt files as
given to `regenerate`, n, seed and the prompts' SHA-256), not their text, which comes from the
user's corpora (here the shared folder's): `restore` builds the same prompts from them again, or
stops if they differ. A target without a chat template (Gemma 3 270M, a base model) writes no
instructions: its folder answers prompt files given to `--prompts` (several, in order), and
`restore` takes the same files. Prompt files made for a target (`bench/task_sources.py`) are
kept beside its data, under `task_prompts/`, and given to `--prompts` in the same order (Gemma 3
answers SmolLM2's task prompts too: its restore names SmolLM2's files, bench/results/README.md). `restore`
unpacks them into the folder, and the same `elsi-fast regenerate` command then continues sampling
and answering where the kept run stopped. Plain JSON only: no file here can execute code when read.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEEP = ROOT / "bench" / "results" / "data"


def keep(folder: Path, target: str) -> Path:
    from elsi_fast.training.corpus_tasks import COPIES_FILE, DOCUMENTS_FILE, TASKS_FILE
    from elsi_fast.training.regenerate import SETTINGS_FILE, export_answers
    from elsi_fast.training.self_instruct import KEPT_FILE, RAW_FILE

    out = KEEP / target
    out.mkdir(parents=True, exist_ok=True)
    sampled = (folder / "self_instruct.json").is_file()
    if sampled:
        shutil.copyfile(folder / "self_instruct.json", out / "self_instruct.json")
    for name in (TASKS_FILE, DOCUMENTS_FILE, COPIES_FILE):
        recipe = (folder / name).with_suffix(".json")
        if (folder / name).is_file():
            if not recipe.is_file():
                raise SystemExit(f"folder: {folder / name} has no recipe beside it ({recipe.name}); rerun the "
                                 "regenerate command that wrote it, which writes the same prompts and their recipe")
            shutil.copyfile(recipe, out / recipe.name)
    for name in (RAW_FILE, KEPT_FILE) if sampled else ():
        # mtime 0: the same data gives the same bytes, so a re-keep leaves git nothing to commit
        with open(folder / name, "rb") as src, gzip.GzipFile(out / (name + ".gz"), "wb", mtime=0) as dst:
            shutil.copyfileobj(src, dst)
    if (folder / SETTINGS_FILE).is_file():
        with gzip.GzipFile(out / "answers.json.gz", "wb", mtime=0) as f:
            f.write(json.dumps(export_answers(folder), separators=(",", ":")).encode())
    return out


def restore(folder: Path, target: str, prompts_paths: list[str], max_new_tokens: int) -> None:
    from elsi_fast.analysis.prompts import load_prompts
    from elsi_fast.targets.loading import load_model
    from elsi_fast.training.corpus_tasks import COPIES_FILE, DOCUMENTS_FILE, TASKS_FILE, rebuild_corpus_tasks
    from elsi_fast.training.regenerate import restore_answers
    from elsi_fast.training.self_instruct import KEPT_FILE, RAW_FILE

    kept = KEEP / target
    if (folder / RAW_FILE).exists():
        raise SystemExit(f"folder: {folder} already holds sampled instructions; restore into a new folder")
    folder.mkdir(parents=True, exist_ok=True)
    sampled = (kept / "self_instruct.json").is_file()
    if sampled:
        shutil.copyfile(kept / "self_instruct.json", folder / "self_instruct.json")
    for name in (RAW_FILE, KEPT_FILE) if sampled else ():
        with gzip.open(kept / (name + ".gz"), "rb") as src, open(folder / name, "wb") as dst:
            shutil.copyfileobj(src, dst)
    tasks = [name for name in (TASKS_FILE, DOCUMENTS_FILE, COPIES_FILE) if (kept / name).with_suffix(".json").is_file()]
    for name in tasks:
        try:
            rebuild_corpus_tasks(json.loads((kept / name).with_suffix(".json").read_text()), folder)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    model, tokenizer = load_model(target, device="cpu", dtype="float32")
    # In the order `regenerate` lists them: --prompts, the sampled instructions, the corpus tasks, the documents,
    # the copies.
    prompts = [prompt for path in prompts_paths for prompt in load_prompts(path)]
    if sampled:
        prompts += load_prompts(str(folder / KEPT_FILE))
    for name in tasks:
        prompts += load_prompts(str(folder / name))
    with gzip.open(kept / "answers.json.gz", "rt") as f:
        exported = json.load(f)
    engine = exported["settings"].get("engine", "transformers")
    written = restore_answers(model, tokenizer, prompts, folder, exported, max_new_tokens=max_new_tokens,
                              engine=engine)
    print(f"restored {written} answers{' and the sampled instructions' if sampled else ''} into {folder}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("keep", "restore"))
    p.add_argument("folder", type=Path)
    p.add_argument("--target", required=True)
    p.add_argument("--prompts", nargs="+", help="restore: the --prompts of the kept regenerate run")
    p.add_argument("--max-new-tokens", type=int, default=256, help="restore: the kept run's --max-new-tokens")
    args = p.parse_args(argv)
    if args.action == "keep":
        print(keep(args.folder, args.target))
    else:
        restore(args.folder, args.target, args.prompts, args.max_new_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
