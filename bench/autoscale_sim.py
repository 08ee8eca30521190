"""The autoscaling policy (zloader/broker/autoscale.py) on simulated jobs of any size.

    python -m bench.autoscale_sim [--needs 2,8,15,32,100,1000] [--out bench/results]

Each job starts with one worker; its consumers wait ``1 - workers / need`` of their time
(plus uniform noise of +-2 points), sampled once a second; the actuator carries out each
decision at once; a cooldown of 30 s. Reported per need: when the count first came within
5% of the need, the count after an hour, the changes in the second half hour (probes),
the largest count asked for, and the decisions of the 32-worker job in full. A job whose
need drops (32, then 8 after 1,000 s) shows the way down. Run it on another checkout
(``PYTHONPATH=that/checkout``) for the policy before a change. Writes
``autoscale_sim.json`` and ``autoscale_sim.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import pathlib
import random
from collections.abc import Callable
from typing import Any

from bench._common import provenance
from zloader.broker.autoscale import Autoscaler

SECONDS = 3600
NOISE = 0.02


def simulate(need: Callable[[int], float], seed: int = 0) -> tuple[list[int], list[float]]:
    """The worker count and the starvation, second by second."""
    rng = random.Random(seed)
    scaler = Autoscaler(cooldown=30.0, max_workers=4096)
    workers, counts, waits = 1, [], []
    for now in range(SECONDS):
        starvation = max(0.0, 1.0 - workers / need(now) + rng.uniform(-NOISE, NOISE))
        workers = scaler.update(float(now), workers, starvation)
        counts.append(workers)
        waits.append(starvation)
    return counts, waits


def _constant(need: float, now: int) -> float:
    return need


def summary(need: int, counts: list[int]) -> dict[str, Any]:
    reached = next((t for t, w in enumerate(counts) if w >= 0.95 * need), None)
    half = counts[SECONDS // 2:]
    return {"need": need, "reached_s": reached, "final": counts[-1], "most": max(counts),
            "changes_second_half": sum(1 for a, b in itertools.pairwise(half) if a != b)}


def decisions(counts: list[int], waits: list[float]) -> list[tuple[int, int, float]]:
    """(second, count asked for, starvation then) at each change."""
    return [(t, b, round(waits[t], 3))
            for t, (a, b) in enumerate(zip([1, *counts], counts, strict=False)) if a != b]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--needs", default="2,8,15,32,100,1000")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    rows, traces = [], {}
    for need in map(int, args.needs.split(",")):
        counts, waits = simulate(functools.partial(_constant, float(need)))
        rows.append(summary(need, counts))
        traces[str(need)] = decisions(counts, waits)
    counts, waits = simulate(lambda now: 32.0 if now < 1000 else 8.0)
    drop = decisions(counts, waits)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "autoscale_sim.json").write_text(json.dumps(
        {"provenance": provenance(), "rows": rows, "decisions": traces, "drop": drop},
        indent=1) + "\n")
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lines = [f"# The autoscaling policy on simulated jobs\n\n`python -m bench.autoscale_sim` "
             f"({when}, commit {provenance()['commit'][:10]}): one worker at first, "
             f"starvation `1 - workers / need` +-{NOISE:.0%}, a cooldown of 30 s.\n",
             "| need | within 5% after | count after 1 h | most asked | changes in the "
             "second half hour |", "|---|---|---|---|---|"]
    for row in rows:
        reached = f"{row['reached_s']} s" if row["reached_s"] is not None else "never"
        lines.append(f"| {row['need']} | {reached} | {row['final']} | {row['most']} | "
                     f"{row['changes_second_half']} |")
    lines.append("\nThe 32-worker job's decisions (second: count asked for, starvation then): "
                 + ", ".join(f"{t} s: {w} ({s})" for t, w, s in traces.get("32", [])[:12]))
    lines.append("\nA job that needs 32, then 8 from 1,000 s: "
                 + ", ".join(f"{t} s: {w}" for t, w, _ in drop[:24]))
    text = "\n".join(lines) + "\n"
    (out / "autoscale_sim.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
