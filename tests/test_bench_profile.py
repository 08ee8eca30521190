"""bench/profile.py runs end to end, tiny: figures per element by thread role, and the
report renders them."""

from __future__ import annotations

import json

import pytest

from bench import profile, report


@pytest.mark.slow  # (over 3 s: the fast suite keeps to 6 minutes on 2 cores)
def test_profile_reports_cpu_and_switches_per_role(tmp_path):
    out = tmp_path / "profile_smoke.json"
    assert profile.main(["--workers", "2", "--window", "1", "--warmup", "0.5", "--rounds", "1",
                         "--exactly-once", "off", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["exactly_once"] == "off"
    chosen = results["rounds"][results["median_round"]]
    assert chosen["elements"] > 0 and chosen["records"] > 0
    roles = {(row["process"], row["role"]): row for row in chosen["roles"]}
    # Thread names reach the kernel, so each role is found where it should be.
    assert roles["trainer", "iterating thread"]["threads"] == 1
    assert roles["trainer", "I/O thread (zloader-loader-io)"]["threads"] == 1
    assert roles["trainer", "broker thread (zloader-broker)"]["threads"] == 1
    assert roles["workers", "main threads"]["threads"] == 2
    assert roles["workers", "producer threads (zloader-producer-*)"]["threads"] >= 2
    assert roles["workers", "ZeroMQ threads (ZMQbg/*)"]["threads"] >= 2
    for process in ("trainer", "workers", "all"):
        assert chosen["totals"][process]["cpu_us"] > 0
        assert chosen["totals"][process]["switches"] > 0
    assert chosen["others_cores"] >= 0
    text = out.with_suffix(".md").read_text()
    assert "| trainer | iterating thread | 1 |" in text and "**all**" in text
    assert report.main(["--results", str(tmp_path), "--out", str(tmp_path)]) == 0
    readme = (tmp_path / "README.md").read_text()
    assert "Per-thread profile of the record path (smoke)" in readme
    assert "renderer failed" not in readme
