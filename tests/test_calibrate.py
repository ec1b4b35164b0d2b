"""The budget policy's start-up measurement (ddtree.calibrate): T(r) over the row counts a step
can use, through the engine's own target backend, measured once per machine and cached."""

from __future__ import annotations

import json

from ddtree import calibrate
from ddtree.config import ModelPairConfig, SamplingParams
from ddtree.engine import Engine
from ddtree.workers.scheduler import row_counts


def test_row_counts_are_the_buckets_under_the_step_limit():
    assert row_counts(1024) == [1, 2, 3, 5, 9, 17, 33, 65, 129, 257, 513, 1024]
    assert row_counts(64) == [1, 2, 3, 5, 9, 17, 33, 64]
    assert row_counts(1) == [1]


def test_step_costs_are_measured_once_per_machine_and_auto_stays_lossless(tiny_chat_model, tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_CALIBRATION", str(tmp_path / "calibration.json"))
    config = ModelPairConfig(model=str(tiny_chat_model), budget="auto", block_size=4, max_step_tokens=64)
    first = Engine.from_config(config)
    assert first.budget == "auto"
    (entry,) = json.loads((tmp_path / "calibration.json").read_text()).values()
    measured = {int(r): s for r, s in entry["step_seconds"].items()}
    assert sorted(measured) == row_counts(64) and all(s > 0 for s in measured.values())
    assert first.scheduler.policy.verify.points == measured
    assert first.scheduler.pool.free_pages == first.scheduler.pool.num_pages, "the measurement's pages came back"

    def no_second_measurement(*args, **kwargs):
        raise AssertionError("the cached step costs should have been used")

    monkeypatch.setattr(calibrate, "measure_step_cost", no_second_measurement)
    again = Engine.from_config(config)
    assert again.scheduler.policy.verify.points == measured

    prompt = again.render_chat([{"role": "user", "content": "hello"}])
    auto = again.generate([again.request(prompt, 12, SamplingParams())])[0]
    plain = again.generate([again.request(prompt, 12, SamplingParams(), budget=0)])[0]
    assert auto.tokens == plain.tokens
