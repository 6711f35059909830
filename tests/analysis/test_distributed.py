"""Data-parallel analysis over 2 gloo processes equals one process."""

import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elsi_fast.analysis.analyze import analyze
from test_analysis import SpecialIds, make_prompts
from tiny_models import tiny_model

OPTIONS = dict(m=(1, 2), batch_size=2, min_token_entropy=0.3, gram_dtype="float64", progress=False)


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        report = analyze(tiny_model("llama", seed=7), SpecialIds(), make_prompts(7, seed=7),
                         state_path=os.path.join(out_dir, "state.pt"), **OPTIONS)
        report.to_json(os.path.join(out_dir, f"report{rank}.json"))
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_equal_one(tmp_path):
    single = analyze(tiny_model("llama", seed=7), SpecialIds(), make_prompts(7, seed=7), **OPTIONS)
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        with open(tmp_path / f"report{rank}.json") as f:
            got = json.load(f)
        assert got["tokens"] == single.tokens
        for a, b in zip(got["layers"], single.layers):
            for key in ("entropy_prompt_mean", "entropy_prompt_std", "entropy_dataset", "renyi2_dataset"):
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9)  # fp32 forwards of differently padded batches
        np.testing.assert_allclose(got["cka"], single.cka, rtol=1e-6)
        np.testing.assert_allclose(got["pair_gain"], single.pair_gain, atol=1e-6)  # fp32 set-entropy solves
        assert got["selections"] == single.selections
    # each rank kept its own resumable state
    assert (tmp_path / "state.pt.rank0").exists() and (tmp_path / "state.pt.rank1").exists()
