"""bench.draft_long_run's --init-from: a cell of the run, or a kept draft folder on a fresh clone."""

from __future__ import annotations

import json

import pytest

from bench.draft_long_run import HELD, continued_from, held_out_openings, held_sets, opening_batch_ids, repeated
from elsi_fast.training.train import SUMMARY_FILE


def test_a_finished_cell_counts_its_parents(tmp_path):
    cell = tmp_path / "elsi-m1-seed0-steps100+50"
    cell.mkdir()
    history = [{"step": s, "tokens": 1000} for s in range(1, 51)]
    (cell / SUMMARY_FILE).write_text(json.dumps({"history": history, "parent_tokens": 7, "parent_steps": 100}))
    assert continued_from(cell.name, tmp_path) == (cell, 7 + 50 * 1000, 150, cell.name)


def test_a_kept_draft_continues_its_source_cell(tmp_path):
    kept = tmp_path / "drafts" / "elsi-m1-11"
    kept.mkdir(parents=True)
    facts = {"tokens_seen": 7657591, "steps": 1780, "source": "runs/long-run/m/elsi-m1-seed0-steps480+400"}
    (kept / "training.json").write_text(json.dumps(facts))
    assert continued_from(str(kept), tmp_path / "work") == (kept, 7657591, 1780, "elsi-m1-seed0-steps480+400")


def test_neither_is_refused_naming_the_argument(tmp_path):
    (tmp_path / "half-written").mkdir()  # a cell whose training never finished
    with pytest.raises(SystemExit, match="--init-from: half-written is neither"):
        continued_from("half-written", tmp_path)


def test_opening_conversations_are_named_by_their_batch(tmp_path):
    records = [{"id": i} for i in ("12", "si-0-3-1", "si-0-4-0", "si-0-10-7")]
    assert opening_batch_ids(records, tmp_path) == []  # no self_instruct.json: no openings
    (tmp_path / "self_instruct.json").write_text(json.dumps({"openings": {"texts": ["Write"], "from_batch": 4}}))
    assert opening_batch_ids(records, tmp_path) == ["si-0-4-0", "si-0-10-7"]


def test_opening_conversations_are_held_out_once_there_are_twice_as_many(tmp_path):
    records = [{"id": str(i)} for i in range(500)]
    held_sets(records, tmp_path, 0, [])  # the split is fixed on the plain data first, as it was
    records += [{"id": f"si-0-9-{j}"} for j in range(399)]
    opening = [r["id"] for r in records[500:]]
    train, _, held_out = held_sets(records, tmp_path, 0, opening)
    assert len(train) == len(records) - HELD and held_out_openings(records, tmp_path) == []
    records.append({"id": "si-0-9-399"})  # the 400th: the split file now fixes HELD of them
    train, _, again = held_sets(records, tmp_path, 0, opening + ["si-0-9-399"])
    held = held_out_openings(records, tmp_path)
    assert again == held_out and len(held) == HELD and {r["id"] for r in held} <= set(opening + ["si-0-9-399"])
    assert not {r["id"] for r in held} & {r["id"] for r in train} and len(train) == len(records) - 2 * HELD
    # fixed: more opening data later leaves the held-out ones as they were
    records += [{"id": f"si-0-10-{j}"} for j in range(50)]
    held_sets(records, tmp_path, 0, opening + ["si-0-9-399"] + [f"si-0-10-{j}" for j in range(50)])
    assert held_out_openings(records, tmp_path) == held


def test_repeated_categories_are_appended_in_order():
    train = [{"id": str(i), "category": "a" if i % 3 else "b"} for i in range(9)]
    out = repeated(train, {"b": 3})
    assert out[:9] == train  # the unrepeated list is a prefix (its feature cache grows from it)
    assert [r["id"] for r in out[9:]] == ["0", "3", "6", "0", "3", "6"]
    with pytest.raises(ValueError, match="'c'"):
        repeated(train, {"c": 2})
