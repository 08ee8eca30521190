"""A coordinated consumer process for tests/test_coordinated.py.

Usage: coord_consumer.py BROKER JOB N INDEX ROUNDS DELAY. Reads one epoch of the groups
pipeline (round x holds x*N .. x*N+N-1) as consumer INDEX of N, printing one JSON line per
element, then one with its stats.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from zloader import Loader, Pipeline


def groups(n: int, rounds: int, delay: float) -> Pipeline:
    def expand(x: int) -> np.ndarray:
        time.sleep(delay)
        return np.arange(x * n, (x + 1) * n)

    return Pipeline.range(rounds, split_size=2).map(expand).unbatch()


def main() -> None:
    broker, job, n, index, rounds, delay = sys.argv[1:7]
    pipeline = groups(int(n), int(rounds), float(delay))
    with Loader(pipeline, broker=broker, job_name=job, num_consumers=int(n),
                consumer_index=int(index), timeout=60) as loader:
        for value in loader:
            print(json.dumps({"v": int(value)}), flush=True)
        stats = loader.stats()
        print(json.dumps({"stats": {k: stats[k] for k in ("dropped", "rounds_lost",
                                                             "rounds_missed")}}), flush=True)


if __name__ == "__main__":
    main()
