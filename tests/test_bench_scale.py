"""bench/scale.py section 1, tiny: each point gets its floor (a paced receiver measured in
the same run) and the trainer's CPU over it; the report renders the new columns."""

from __future__ import annotations

import json

import pytest

from bench import report, scale


@pytest.mark.slow  # (over 3 s: the fast suite keeps to 6 minutes on 2 cores)
def test_scale_point_has_a_floor_and_the_trainer_over_it(tmp_path):
    assert scale.main(["--points", "embedded=1", "--window", "1", "--warmup", "0.5",
                       "--only", "scale", "--name", "scale_smoke",
                       "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "scale_smoke.json").read_text())
    (point,) = results["scale"]
    assert "error" not in point and "floor_error" not in point
    for key in ("consumer_us_per_element", "workers_us_per_element",
                "workers_trainer_us_per_element", "floor_us_per_message",
                "floor_switches_per_message", "floor_rate", "trainer_over_floor",
                "consumer_switches_per_element"):
        assert point[key] > 0, key
    assert point["others_cores"] >= 0
    text = (tmp_path / "scale_smoke.md").read_text()
    assert "| floor | trainer / floor |" in text and "Load average" in text
    assert text.count(" switches)") >= 2  # (the trainer's wake-ups and the floor's)
    assert report.main(["--results", str(tmp_path), "--out", str(tmp_path)]) == 0
    readme = (tmp_path / "README.md").read_text()
    assert "Scale-out: throughput against workers (smoke)" in readme
    assert "trainer / floor" in readme and "renderer failed" not in readme


def test_points_pick_modes_and_counts():
    assert scale.parse_points(["embedded=1,8", "tcp=8"], "1", "embedded") == [
        ("embedded", 1), ("embedded", 8), ("tcp", 8)]
    assert scale.parse_points(None, "1,2", "embedded,tcp") == [
        ("embedded", 1), ("tcp", 1), ("embedded", 2), ("tcp", 2)]
