"""bench/startup.py section 9, small: the CPU of a first batch counts the trainer and
every worker (read while they run), for both loaders, and the table shows it."""

from __future__ import annotations

import pytest

from bench import startup


def test_the_first_batch_s_cpu_counts_the_trainer_and_its_workers():
    dataset = startup.Pairs(2_000)
    row = {"case": "small, 2 workers", "workers": 2, "cores": 2}
    for name in startup.LOADERS:
        cpu = startup.first_batch_cpu(name, dataset, 2)
        assert cpu["wall"] > 0 and cpu["trainer"] > 0, (name, cpu)
        # (the workers were alive at the first batch: a worker's start alone is CPU)
        assert cpu["workers"] > 0, (name, cpu)
        assert cpu["total"] == pytest.approx(cpu["trainer"] + cpu["workers"])
        row[name] = cpu
    text = "\n".join(startup.tables({"date": "2026-12-07", "cpu_count": 2,
                                     "commit": "0" * 40, "first_batch_cpu": [row]}))
    assert "## (9) The CPU of the first batch" in text
    zloader_line = next(line for line in text.splitlines()
                        if line.startswith("| small, 2 workers | zloader |"))
    ratio = row["zloader"]["total"] / row["torch"]["total"]
    assert zloader_line.endswith(f"| {ratio:.2f} |")


def test_a_process_gone_counts_for_nothing():
    assert startup._threads_cpu(2**22 + 12345) == 0.0
