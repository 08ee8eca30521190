"""bench/_fleet.py: a tiny simulated fleet against a real broker gives sane figures."""

from __future__ import annotations

import argparse

import pytest

from bench._fleet import fleet_section, fleet_table


@pytest.mark.slow
def test_tiny_fleet_registers_and_measures_the_broker():
    args = argparse.Namespace(fleet_workers=20, fleet_consumers=5, fleet_seconds=2.0,
                              fleet_warmup=1.0, fleet_epoch_every=0.5)
    result = fleet_section(args)
    assert result["errors"] == []
    status = result["broker_status"]
    assert (status["workers"], status["consumers"], status["jobs"]) == (20, 5, 1)
    assert status["job_workers_min"] == 20  # every worker placed on the one job
    assert 0 <= result["broker_cpu"] < 2.0  # a share of one core, at most the machine's
    # five consumers, an EPOCH each every 0.5 s over 2 s: answered, none lost
    assert result["epochs"] >= 10 and result["epoch_unanswered"] == 0
    assert 0 < result["epoch_p50_s"] <= result["epoch_p99_s"] <= result["epoch_max_s"] < 5
    assert result["to_broker_per_s"] > 20 and result["from_broker_per_s"] > 20  # beats
    assert result["moves"] == {"TASK": 0, "RELEASE": 0} and result["forgotten"] == 0
    assert result["fleet_at_target"] is None or result["fleet_at_target"] > 0
    lines = fleet_table(result)
    assert lines[2].startswith("| figure |") and any("p99" in line for line in lines)
