"""The compiled core against its pure-Python twins (docs/native.md), side by side in one run.

Each row of bench.transport that the per-record path bounds runs in a fresh process with the
compiled core and in one with ``ZLOADER_PURE=1``, the two interleaved, ``--rounds`` times
(default 3); a row's figure is the median of its rounds. Rows: (c) small elements
(``Pipeline.range(10**9)``, 2 embedded workers), (g) shuffled batches of 256 ints
(``range(10**9).shuffle(1024).batch(256)``), each with exactly-once on and off, and (a) the
9.6 MB batches (the copy bounds it: a check that nothing there got slower). Per row:
elements (or batches, or GB) per second and the CPU all processes spent per element, both
kernels; then the exactly-once on/off ratio of (c) and (g) with each. Then bench.scale's
lone record: 8 embedded workers, elements of 10 ms of waiting, each alone in its record,
the trainer's CPU per record and the workers' and trainer's together.

    python -m bench.native [--rounds 3] [--window 5] [--warmup 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

from bench._common import REPO, provenance, write_results

ROWS = {  # name -> (bench.transport function, metric)
    "c: small, exactly-once on": ("zloader_small", "elements_per_s"),
    "c: small, exactly-once off": ("zloader_small_untracked", "elements_per_s"),
    "g: shuffled batches, exactly-once on": ("zloader_batched", "elements_per_s"),
    "g: shuffled batches, exactly-once off": ("zloader_batched_untracked", "elements_per_s"),
    "a: 9.6 MB batches": ("zloader_large", "gb_per_s"),
}
LONE = "lone record, 8 workers, 10 ms elements"
"""bench.scale's point (embedded, 8 workers): CPU per record, not throughput."""
KERNELS = ("compiled", "pure")


def _one(function: str, window: float, warmup: float) -> None:
    """Run one row here and print its result as JSON (the child's side)."""
    import bench.transport as transport
    from zloader import _native

    if function == "scale_lone":
        from bench.scale import scale_point

        point = argparse.Namespace(element_ms=10.0, window=window, warmup=warmup,
                                   floor_seconds=0.0)
        result = scale_point("embedded", 8, point)
        print(json.dumps({**result, "compiled": _native.ACTIVE}))
        return
    kwargs: dict[str, Any] = {}
    name = function
    if name.endswith("_untracked"):
        kwargs["exactly_once"] = False
        name = name[:-len("_untracked")]
    pipelines = {"zloader_small": lambda z: z.Pipeline.range(10**9),
                 "zloader_batched": transport._batched,
                 "zloader_large": transport._large_pipeline}
    out = transport.zloader_throughput(pipelines[name], window, warmup, cpu=True, **kwargs)
    print(json.dumps({**out, "compiled": _native.ACTIVE}))


def _run(function: str, kernel: str, window: float, warmup: float) -> dict[str, Any]:
    env = dict(os.environ, ZLOADER_PURE="1" if kernel == "pure" else "0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-m", "bench.native", "--child", function,
                           "--window", str(window), "--warmup", str(warmup)],
                          cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120 + 2 * (window + warmup))
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if result["compiled"] != (kernel == "compiled"):
        return {"error": [f"asked for {kernel} kernels, ran "
                          f"{'compiled' if result['compiled'] else 'pure'} ones "
                          "(is the compiled core built? pip install -e .)"]}
    return result


def _median(results: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in results if "error" not in r]
    return statistics.median(values) if values else None


def _text(metric: str, value: float | None) -> str:
    if value is None:
        return "failed"
    return f"{value:.2f} GB/s" if metric == "gb_per_s" else f"{value:,.0f}/s"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per row")
    parser.add_argument("--window", type=float, default=5.0, help="seconds measured per run")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before the window")
    parser.add_argument("--out", default="bench/results", help="where to write results")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _one(args.child, args.window, args.warmup)
        return
    rows = {**{row: function for row, (function, _) in ROWS.items()}, LONE: "scale_lone"}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        row: {kernel: [] for kernel in KERNELS} for row in rows}
    for round_ in range(args.rounds):
        for row, function in rows.items():
            for kernel in (KERNELS if round_ % 2 == 0 else KERNELS[::-1]):
                runs[row][kernel].append(_run(function, kernel, args.window, args.warmup))
                print(f"round {round_ + 1}, {row}, {kernel}: {runs[row][kernel][-1]}",
                      file=sys.stderr)
    medians: dict[str, dict[str, float | None]] = {}
    for row, (_, metric) in ROWS.items():
        medians[row] = {f"{k}_{key}": _median(runs[row][k], key)
                        for k in KERNELS for key in (metric, "cpu_ms_per_element")}
    medians[LONE] = {f"{k}_{key}": _median(runs[LONE][k], key) for k in KERNELS
                     for key in ("consumer_us_per_element", "workers_trainer_us_per_element")}
    errors = sorted({e for row in runs.values() for rs in row.values() for r in rs
                     for e in r.get("error", [])})
    data = {"provenance": provenance(), "args": vars(args), "runs": runs,
            "medians": medians, "errors": errors}
    write_results(args.out, "native", data, tables(data))


def tables(data: dict[str, Any]) -> list[str]:
    """The result's tables (a heading first), from what :func:`main` saved."""
    args, medians = data["args"], data["medians"]
    lines = ["# The compiled core against its pure-Python twins", "",
             f"{args['rounds']} interleaved rounds, {args['window']:g} s windows, medians; "
             "CPU: all processes (the trainer and its 2 workers) per element.", "",
             "| row | compiled | pure | compiled / pure | CPU per element, compiled | "
             "CPU per element, pure |", "|---|---|---|---|---|---|"]
    for row, (_, metric) in ROWS.items():
        rate = {k: medians[row][f"{k}_{metric}"] for k in KERNELS}
        cpu = {k: medians[row][f"{k}_cpu_ms_per_element"] for k in KERNELS}
        ratio = (f"{rate['compiled'] / rate['pure']:.2f}"
                 if rate["compiled"] and rate["pure"] else "-")
        lines.append(f"| {row} | {_text(metric, rate['compiled'])} | "
                     f"{_text(metric, rate['pure'])} | {ratio} | "
                     + " | ".join(f"{1000 * cpu[k]:.1f} µs" if cpu[k] else "-"
                                  for k in KERNELS) + " |")
    lines += ["", "| exactly-once on / off | compiled | pure |", "|---|---|---|"]
    for section in ("c: small", "g: shuffled batches"):
        on, off = (f"{section}, exactly-once {s}" for s in ("on", "off"))
        cells = []
        for kernel in KERNELS:
            a, b = (medians[r][f"{kernel}_elements_per_s"] for r in (on, off))
            cells.append(f"{a / b:.2f}" if a and b else "-")
        lines.append(f"| {section} | {' | '.join(cells)} |")
    if LONE in medians:
        lone = medians[LONE]
        lines += ["", f"| {LONE} | compiled | pure |", "|---|---|---|"]
        for label, key in (("the trainer's CPU per record", "consumer_us_per_element"),
                           ("workers + trainer per record", "workers_trainer_us_per_element")):
            lines.append(f"| {label} | " + " | ".join(
                f"{lone[f'{k}_{key}']:.0f} µs" if lone[f"{k}_{key}"] else "-"
                for k in KERNELS) + " |")
    if data["errors"]:
        lines += ["", "Errors: " + "; ".join(data["errors"])]
    return lines


if __name__ == "__main__":
    main()
