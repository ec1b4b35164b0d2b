"""`budget: auto`: the choice rule, and that a machine measures once."""

from __future__ import annotations

import json

import pytest

from ddtree import calibrate
from ddtree.calibrate import CANDIDATES, choose_budget
from ddtree.config import ModelPairConfig, SamplingParams
from ddtree.engine import Engine


@pytest.mark.parametrize(
    "rates,expected",
    [
        ({0: 10.0, "chain": 10.5, 16: 9.0}, 0),  # 5% faster is within noise: stay plain
        ({0: 10.0, "chain": 11.5, 16: 12.0}, 16),
        ({0: 10.0, 8: 3.0}, 0),
        ({0: 10.0, "chain": 30.0, 16: 25.0}, "chain"),
    ],
)
def test_choose_budget(rates, expected):
    assert choose_budget(rates) == expected


def test_auto_measures_once_per_machine_and_stays_lossless(tiny_chat_model, tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_CALIBRATION", str(tmp_path / "calibration.json"))
    config = ModelPairConfig(model=str(tiny_chat_model), budget="auto", block_size=4)
    first = Engine.from_config(config)
    assert first.budget in CANDIDATES
    table = json.loads((tmp_path / "calibration.json").read_text())
    (entry,) = table.values()
    assert entry["budget"] == first.budget and set(entry["tokens_per_s"]) == {str(c) for c in CANDIDATES}

    def no_second_measurement(engine, candidates=CANDIDATES):
        raise AssertionError("the cached choice should have been used")

    monkeypatch.setattr(calibrate, "measure", no_second_measurement)
    again = Engine.from_config(config)
    assert again.budget == first.budget

    prompt = again.render_chat([{"role": "user", "content": "hello"}])
    auto = again.generate([again.request(prompt, 12, SamplingParams())])[0]
    plain = again.generate([again.request(prompt, 12, SamplingParams(), budget=0)])[0]
    assert auto.tokens == plain.tokens
