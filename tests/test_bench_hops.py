"""bench/hops.py runs end to end, tiny, and reports a cost for each hop."""

from __future__ import annotations

import json

from bench import hops


def test_hops_measures_a_process_hop_and_a_thread_hop(tmp_path):
    assert hops.main(["--messages", "50", "--repeats", "1", "--seconds", "0.3",
                      "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "hops.json").read_text())
    for hop in ("process_hop", "thread_hop"):
        assert results[hop]["cpu_us"] > 0 and results[hop]["wall_us"] > 0
    assert results["python_loop"]["loop_ms"] > 0
    floor = results["paced_floor"]
    assert floor["cpu_us"] > 0 and floor["switches"] > 0 and floor["achieved_rate"] > 0
    text = (tmp_path / "hops.md").read_text()
    assert "process to process" in text and "paced receiver" in text
