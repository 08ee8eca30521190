"""Generated cases over seeds no test fixes, several at once, beside busy CPUs: how the two
exactly-once bugs of 2026-12-06 were found (rows repeated when two ``job_name`` Loaders'
words about one group were merged again; rows lost when a paused worker came back while a
mix drawn in the consumer was read to its end). Each failed about once in 30-160 runs of
its seed, and only under load, so ``make test``'s one seed per mode showed it as a flake.

``python -m tests.sweep --modes split,pause --seeds 1000:1040 --runs 3 --burn 1`` runs
each mode of tests/test_generated.py (``MODES`` and the service ones, as ``run`` names
them) for each seed, ``--runs`` cases at a time in processes of their own (each runs case
after case, as a pytest-xdist worker does), while ``--burn`` processes spin; ``--torch
600:660`` adds tests/test_torch_generated.py's drop-in cases for those seeds, and
``--repeat N`` runs each case N times (``--modes shared-prefix-move --seeds 701:702
--runs 3 --repeat 300``: the late-joiner loss of docs/sharing.md, "Moves", in about 1%
of runs). Every
failure is printed with its mode, seed and message (the recipe is in it), and the exit
status is 1 if any. ``make sweep`` runs a default mix.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import sys
import tempfile
import time
import traceback
from typing import Any


def _seeds(text: str) -> range:
    first, _, last = text.partition(":")
    return range(int(first), int(last))


def _case(kind: str, mode: str, seed: int) -> tuple[str, str, int, str]:
    """Run one case; ``(kind, mode, seed, failure or "")``."""
    try:
        if kind == "torch":
            from tests import test_torch_generated
            test_torch_generated._run(seed)
        else:
            from tests import test_generated
            with tempfile.TemporaryDirectory() as tmp:
                test_generated.run(mode, seed, tmp)
    except Exception as exc:  # (a failure is the sweep's finding, not its end)
        text = "".join(traceback.format_exception_only(exc)).strip()
        return kind, mode, seed, text
    return kind, mode, seed, ""


def _burn(seconds: float) -> None:
    """Keep one CPU busy for ``seconds`` (a loaded host, where the races show)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="split,pause,kill,shared-pause",
                        help="test_generated modes, comma-separated")
    parser.add_argument("--seeds", default="1000:1020", help="FIRST:END of the seeds")
    parser.add_argument("--torch", default="", help="FIRST:END of drop-in seeds (none: '')")
    parser.add_argument("--runs", type=int, default=2, help="cases at a time")
    parser.add_argument("--burn", type=int, default=1, help="CPU-burning processes beside")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run each case this many times (a race seen once in 50-100)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.burn < 0 or args.repeat < 1:
        parser.error("--runs and --repeat must be >= 1 and --burn >= 0")
    cases: list[tuple[str, str, int]] = [("generated", mode, seed)
                                         for seed in _seeds(args.seeds)
                                         for mode in args.modes.split(",") if mode]
    cases += [("torch", "drop-in", seed) for seed in (_seeds(args.torch) if args.torch
                                                      else ())]
    cases *= args.repeat
    if not cases:
        parser.error("no cases: give --modes and --seeds, or --torch")
    # (spawned: none of this process's state; each runs case after case, as an xdist worker)
    context = multiprocessing.get_context("spawn")
    burners = [context.Process(target=_burn, args=(24 * 3600,), daemon=True)
               for _ in range(args.burn)]
    for burner in burners:
        burner.start()
    failures: list[Any] = []
    started = time.monotonic()
    try:
        with concurrent.futures.ProcessPoolExecutor(args.runs, mp_context=context) as pool:
            for kind, mode, seed, failure in pool.map(_case, *zip(*cases, strict=True)):
                if failure:
                    failures.append((kind, mode, seed))
                    print(f"FAIL {kind} {mode} seed {seed}: {failure}", flush=True)
    finally:
        for burner in burners:
            burner.terminate()
            burner.join()
    print(f"{len(failures)} failed of {len(cases)} in {time.monotonic() - started:.0f} s",
          flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
