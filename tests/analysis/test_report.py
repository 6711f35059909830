"""LayerReport: JSON schema and round trip, selection after loading, serving configs, plots."""

import itertools
import json

import numpy as np
import pytest

from elsi_fast.analysis.analyze import analyze
from elsi_fast.analysis.report import LayerReport
from test_analysis import SpecialIds, make_prompts
from tiny_models import tiny_model


@pytest.fixture(scope="module")
def report():
    model = tiny_model("llama", num_hidden_layers=6, seed=11)
    return analyze(model, SpecialIds(), make_prompts(5, seed=11), m=(1, 3), min_token_entropy=0.2, progress=False)


def test_json_schema_and_round_trip(report, tmp_path):
    path = tmp_path / "report.json"
    report.to_json(str(path))
    data = json.loads(path.read_text())
    assert data["num_hidden_layers"] == 6
    assert [layer["index"] for layer in data["layers"]] == list(range(7))
    assert {"entropy_prompt_mean", "entropy_prompt_std", "entropy_dataset"} <= set(data["layers"][0])
    assert np.array(data["cka"]).shape == (7, 7)
    covered = [l for first, last in data["compartments"] for l in range(first, last + 1)]
    assert covered == list(range(7))
    assert set(data["selections"]) == {"elsi", "elsi-c", "eagle3", "low-entropy", "last", "uniform"}
    assert data["selections"]["eagle3"] == {"3": [2, 3, 3]} and data["selections"]["last"] == {"1": [6]}
    assert set(data["selections"]["elsi"]) == {"1", "3"}
    assert data["tokens"]["kept"] <= data["tokens"]["candidates"] <= data["tokens"]["total"]
    assert data["options"]["min_token_entropy"] == 0.2 and data["options"]["m"] == [1, 3]
    loaded = LayerReport.from_json(str(path))
    assert loaded.to_dict() == json.loads(json.dumps(report.to_dict()))
    assert loaded.select("elsi", 3) == report.select("elsi", 3)
    assert loaded.select("uniform", 2) == [2, 4]  # rules work without the analysis session
    with pytest.raises(ValueError, match="only available in the session"):
        loaded.select("elsi", 2)


def test_select_in_session_for_new_m_and_consistency(report):
    two = report.select("elsi", 2)
    assert len(two) == 2 and all(1 <= l <= 5 for l in two)  # default candidates 1..N-1
    value = report.set_values["elsi"]["2"]
    assert value == pytest.approx(report.set_entropy([tuple(two)])[0])
    singles = report.set_entropy([(l,) for l in range(1, 6)])
    assert report.select("elsi", 1) == [1 + int(np.argmax(singles))]
    assert report.select("low-entropy", 1) == [int(np.argmin(report.set_entropy([(l,) for l in range(0, 6)])))]
    subsets = list(itertools.combinations(range(1, 6), 3))
    values = report.set_entropy(subsets)
    assert report.search["elsi"]["3"] == "exhaustive"  # C(5, 3) = 10 sets
    assert report.select("elsi", 3) == list(subsets[int(np.argmax(values))])
    assert report.select("low-entropy", 3) == list(
        min(itertools.combinations(range(0, 6), 3), key=lambda s: report.set_entropy([s])[0]))
    gains = report.greedy_gains["elsi"]["3"]
    assert gains[0] == pytest.approx(singles.max())
    for method, m in (("eagle3", 2), ("last", 3), ("nope", 1)):
        with pytest.raises(ValueError, match="m|method"):
            report.select(method, m)


def test_serving_configs_and_warnings(report):
    layers = report.select("elsi", 3)
    assert report.serving_config("vllm", m=3) == {"eagle_aux_hidden_state_layer_ids": layers,
                                                  "num_aux_hidden_states": 3}
    assert report.serving_config("trtllm", m=3)["eagle3_layers_to_capture"] == [l - 1 for l in layers]
    with pytest.warns(UserWarning, match="specforge: m=1: SpecForge 0.2 accepts exactly 3"):
        report.serving_config("specforge", m=1)
    with pytest.raises(ValueError, match="engine"):
        report.serving_config("nope")


def test_plots_and_table(report, tmp_path):
    paths = report.plot(str(tmp_path))
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == ["cka.png", "entropy.png", "pair_gain.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    table = report.table()
    assert "elsi" in table and "low-entropy" in table and "h_0..h_6" in table


def test_from_json_rejects_other_files(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"model": "m"}))
    with pytest.raises(ValueError, match="lacks"):
        LayerReport.from_json(str(path))
