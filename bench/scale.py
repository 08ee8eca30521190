"""Scale-out benchmark: throughput against the number of workers, several jobs on one
pool, and the broker's control plane alone.

(1) **Scale-out.** ``Pipeline.range(N).map(wait)`` where ``wait`` sleeps ``--element-ms``
    (default 10 ms) and returns the index: per-element cost that is wall time, not this
    host's CPU, standing in for CPU on other hosts. With ``w`` workers the ideal is
    ``w * 1000 / element_ms`` elements/s; efficiency = measured / ideal. Two modes:
    *embedded* (``Loader(pipeline, num_workers=w)``: the Loader forks its workers, rings on
    this host) and *tcp* (a ``zloader-broker`` process on 127.0.0.1 and ``zloader-worker
    --processes w``, the Loader reading over TCP with ``transport="tcp"``). CPU per element
    is the CPU every process of the run spent (this one, the broker, the workers) over the
    window, divided by the elements; "the trainer's" is this process's share of it (the
    consumer, with the broker's thread when embedded); "workers + trainer" leaves out a
    broker process (tcp). Each element goes alone in a record (it takes longer than the
    producer's RECORD_LINGER), so per element is per record.
    **The floor**, measured in the same run right after each point (bench/hops.py
    ``paced_floor``): a bare Python process woken once per ZeroMQ message (a PUSH/PULL pair
    over ipc between two processes, one small message per record) paced at the elements/s
    the point achieved; its CPU per message, and "trainer / floor", the trainer's CPU per
    record over it. Next to each, its voluntary context switches (the trainer's iterating
    thread's per record, the floor's per message): how often it slept for the next one.
    The trainer's CPU is mostly a cost per wake-up (cold caches), so records that come
    together, found without a sleep, cost less each. Targets on a 2-core machine (issue
    26, and [4/6] for tcp): efficiency >= 0.85 at 32 workers in both modes and at 64
    embedded, >= 0.8 at 64 over tcp; at 8 workers, trainer / floor <= 3 and workers +
    trainer <= 250 µs per record.
(2) **Several jobs on one pool.** A broker and ``zloader-worker --processes 8``; three
    jobs (Loaders in this process, one thread each) start together, a fourth joins
    ``--late`` seconds later: the seconds it waits for its first element, then each job's
    share of the elements over the window (equal shares are 0.25 each).
(3) **The control plane alone** (``--only fleet``, bench/_fleet.py): a broker process and
    simulated peers that speak the protocol with no pipeline, all sockets of this process:
    ``--fleet-workers`` workers (READY, then a HEARTBEAT a second) and ``--fleet-consumers``
    consumers, five to a job (REGISTER, then a HEARTBEAT a second and an EPOCH every
    ``--fleet-epoch-every`` seconds), beats spread over the second. Once the pool has
    settled (no worker moved for 2 s) and ``--fleet-warmup`` seconds more, over
    ``--fleet-seconds``: broker CPU (fraction of one core),
    the latency of each EPOCH's answer (its JOB view: p50, p99, max) and messages per
    second each way. Targets: < 30% of one core, p99 < 50 ms at 1,000 workers and 200
    consumers; the fleet size one broker can run at 30% of a core is extrapolated from its
    CPU per peer (linearly), and the simulator's own CPU is reported next to the broker's.

Ratios and efficiencies are what to read: the machine is shared and noisy.

Run: ``python -m bench.scale [--workers 1,2,4,8,16,32,64] [--modes embedded,tcp]
[--floor-seconds S] [--only scale,jobs,fleet] [--out bench/results]``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import pathlib
import platform
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil

from bench._common import free_port, provenance, stop, tree_cpu
from bench.hops import paced_floor

BIN = pathlib.Path(sys.executable).parent
START_TIMEOUT_S = 120.0
EFFICIENCY_TARGETS = {("embedded", 32): 0.85, ("tcp", 32): 0.85, ("embedded", 64): 0.85,
                      ("tcp", 64): 0.8}
"""Issue 26's targets for section 1's efficiency, by (mode, workers)."""
TRAINER_OVER_FLOOR_TARGET = 3.0
"""... for the trainer's CPU per record over the floor's, at TARGET_WORKERS."""
WORKERS_TRAINER_TARGET_US = 250.0
"""... for workers + trainer CPU per record, at TARGET_WORKERS."""
TARGET_WORKERS = 8


def wait(ms: float, index: int) -> int:
    """One element: ``ms`` milliseconds of waiting, not of this host's CPU."""
    time.sleep(ms / 1000)
    return index


def pipeline(element_ms: float) -> Any:
    import zloader

    return zloader.Pipeline.range(10**9).map(functools.partial(wait, element_ms))


def machine_busy() -> float:
    """CPU seconds every process of this machine has used so far (/proc/stat: all but
    idle and iowait), to tell how busy others kept it during a window."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def measure(iterator: Iterator[Any], window: float, warmup: float,
            roots: list[psutil.Process],
            parts: dict[str, Callable[[], float]] | None = None) -> dict[str, Any]:
    """The first element, ``warmup`` seconds, then elements and CPU over ``window``: of
    ``roots`` and their descendants in all, of this process alone, and of each of
    ``parts`` (a name and a function reading its CPU seconds so far) as
    ``<name>_us_per_element``."""
    parts = parts or {}
    start = time.perf_counter()
    next(iterator)
    first = time.perf_counter()
    while time.perf_counter() - first < warmup:
        next(iterator)
    me = psutil.Process()
    before = {name: read() for name, read in parts.items()}
    woken0 = me.num_ctx_switches().voluntary  # (the main thread's: the one iterating)
    cpu0, own0, busy0, t0 = tree_cpu(*roots), _cpu(me), machine_busy(), time.perf_counter()
    elements = 0
    while True:
        next(iterator)
        elements += 1
        now = time.perf_counter()
        if now >= t0 + window:
            break
    cpu, own, busy = tree_cpu(*roots) - cpu0, _cpu(me) - own0, machine_busy() - busy0
    woken = me.num_ctx_switches().voluntary - woken0
    spent = {name: read() - before[name] for name, read in parts.items()}
    seconds = now - t0
    return {"first_element_s": first - start, "elements": elements, "seconds": seconds,
            "elements_per_s": elements / seconds, "cpu_s": cpu,
            "cpu_us_per_element": cpu / max(1, elements) * 1e6,
            "consumer_us_per_element": own / max(1, elements) * 1e6,
            "consumer_switches_per_element": woken / max(1, elements),
            "others_cores": max(0.0, busy - cpu) / seconds,
            **{f"{name}_us_per_element": value / max(1, elements) * 1e6
               for name, value in spent.items()}}


def _cpu(process: psutil.Process) -> float:
    """CPU seconds of ``process`` alone (the trainer: the consumer, and an embedded
    broker's thread)."""
    times = process.cpu_times()
    return times.user + times.system


@contextlib.contextmanager
def service(processes: int) -> Iterator[tuple[str, list[subprocess.Popen[bytes]]]]:
    """A ``zloader-broker`` on 127.0.0.1 and ``zloader-worker --processes N`` (all of them
    registered before this yields)."""
    from zloader._status import fetch_status

    address = f"tcp://127.0.0.1:{free_port()}"
    started = [subprocess.Popen([str(BIN / "zloader-broker"), "--bind", address,
                                 "--log-level", "error"])]
    try:
        if processes:
            started.append(subprocess.Popen(
                [str(BIN / "zloader-worker"), "--broker", address, "--processes",
                 str(processes), "--log-level", "error"]))
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with contextlib.suppress(Exception):
                if len(fetch_status(address, None, 2.0).get("workers", [])) >= processes:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{processes} workers did not register within "
                                   f"{START_TIMEOUT_S:.0f} s")
            time.sleep(0.2)
        yield address, started
    finally:
        stop(list(reversed(started)), 20)


# --- (1) scale-out ----------------------------------------------------------------------------

def scale_point(mode: str, workers: int, args: argparse.Namespace) -> dict[str, Any]:
    import zloader

    me = psutil.Process()
    ideal = workers * 1000 / args.element_ms
    load = os.getloadavg()[0]
    started = time.perf_counter()
    if mode == "embedded":
        with zloader.Loader(pipeline(args.element_ms), num_workers=workers,
                            timeout=60) as loader:
            # The workers are this process's children (forked); the broker is a thread.
            result = measure(iter(loader), args.window, args.warmup, [me],
                             {"workers": lambda: tree_cpu(*me.children())})
    else:
        with service(workers) as (address, processes), \
                zloader.Loader(pipeline(args.element_ms), broker=address, num_workers=0,
                               transport="tcp", timeout=60) as loader:
            broker, pool = (psutil.Process(p.pid) for p in processes)
            result = measure(iter(loader), args.window, args.warmup, [me, broker, pool],
                             {"workers": lambda: tree_cpu(pool),
                              "broker": lambda: tree_cpu(broker)})
    result.update(mode=mode, workers=workers, ideal_per_s=ideal,
                  efficiency=result["elements_per_s"] / ideal,
                  workers_trainer_us_per_element=result["consumer_us_per_element"]
                  + result["workers_us_per_element"],
                  load_1min=load, wall_s=time.perf_counter() - started)
    if args.floor_seconds > 0:
        result.update(floor_point(result["elements_per_s"], args.floor_seconds,
                                  result["consumer_us_per_element"]))
    return result


def floor_point(rate: float, seconds: float, trainer_us: float) -> dict[str, Any]:
    """The floor at ``rate`` (a receiver woken once per message, bench/hops.py) and the
    trainer's CPU per record over it; a failure is recorded, not raised."""
    try:
        floor = paced_floor(rate, seconds)
    except Exception as exc:  # the point's own figures stand without it
        return {"floor_error": repr(exc)}
    return {"floor_us_per_message": floor["cpu_us"],
            "floor_switches_per_message": floor["switches"],
            "floor_rate": floor["achieved_rate"],
            "trainer_over_floor": trainer_us / floor["cpu_us"] if floor["cpu_us"] else None}


def scale_section(args: argparse.Namespace) -> list[dict[str, Any]]:
    points = []
    for mode, workers in args.points:
        try:
            point = scale_point(mode, workers, args)
        except Exception as exc:  # one failing point must not lose the others
            point = {"mode": mode, "workers": workers, "error": repr(exc)}
        print(json.dumps(point), flush=True)
        points.append(point)
    return points


def parse_points(points: list[str] | None, workers: str, modes: str) -> list[tuple[str, int]]:
    """Section 1's (mode, workers) in the order run: each ``--points MODE=W,W...`` in
    turn, or else every count of ``--workers`` in every mode of ``--modes``."""
    if not points:
        return [(mode, int(w)) for w in workers.split(",") for mode in modes.split(",")]
    chosen = []
    for spec in points:
        mode, _, counts = spec.partition("=")
        if mode not in ("embedded", "tcp") or not counts:
            raise SystemExit(f"--points {spec!r}: expected embedded=W,W... or tcp=W,W...")
        chosen += [(mode, int(w)) for w in counts.split(",")]
    return chosen


# --- (2) several jobs -------------------------------------------------------------------------

def jobs_section(args: argparse.Namespace) -> dict[str, Any]:
    import zloader

    counts = [0, 0, 0, 0]
    first: list[float | None] = [None] * 4
    stop_at = threading.Event()
    errors: list[str] = []

    def consume(job: int, address: str, started: float) -> None:
        try:
            with zloader.Loader(pipeline(args.element_ms), broker=address, num_workers=0,
                                transport="tcp", timeout=60, job_name=f"job{job}") as loader:
                for _ in loader:
                    if first[job] is None:
                        first[job] = time.perf_counter() - started
                    if counting.is_set():
                        counts[job] += 1
                    if stop_at.is_set():
                        return
        except Exception as exc:
            errors.append(f"job{job}: {exc!r}")

    counting = threading.Event()
    with service(args.pool) as (address, _processes):
        threads = []
        t0 = time.perf_counter()
        for job in range(3):
            threads.append(threading.Thread(target=consume, args=(job, address, t0)))
            threads[-1].start()
        time.sleep(args.late)
        late_start = time.perf_counter()
        threads.append(threading.Thread(target=consume, args=(3, address, late_start)))
        threads[-1].start()
        time.sleep(args.warmup + 2.0)  # the pool moves workers to the late job
        counting.set()
        time.sleep(args.window)
        counting.clear()
        stop_at.set()
        for thread in threads:
            thread.join(60)
    total = sum(counts) or 1
    return {"pool": args.pool, "jobs": 4, "late_s": args.late,
            "late_first_element_s": first[3], "first_element_s": first,
            "elements": counts, "shares": [c / total for c in counts],
            "max_share_error": max(abs(c / total - 0.25) / 0.25 for c in counts),
            "errors": errors}


# --- report -----------------------------------------------------------------------------------

def _us(value: Any) -> str:
    return f"{value:.0f} µs" if isinstance(value, int | float) else "-"


def _switches(point: dict[str, Any]) -> str:
    """The iterating thread's voluntary context switches per element (its sleeps for the
    next one), as the floor's per message are shown."""
    value = point.get("consumer_switches_per_element")
    return f" ({value:.1f} switches)" if isinstance(value, int | float) else ""


def _ratio(value: Any) -> str:
    return f"{value:.1f}x" if isinstance(value, int | float) else "-"


def scale_table(points: list[dict[str, Any]]) -> list[str]:
    """Section 1 as a markdown table, then a line per issue-26 target at TARGET_WORKERS."""
    lines = ["| mode | workers | elements/s | ideal | efficiency | target | holds | "
             "CPU per element | of it, the trainer's | workers + trainer | floor | "
             "trainer / floor | load | others' CPU |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        if "error" in p:
            lines.append(f"| {p['mode']} | {p['workers']} | failed: {p['error']} "
                         "| | | | | | | | | | | |")
            continue
        target = EFFICIENCY_TARGETS.get((p["mode"], p["workers"]))
        holds = "-" if target is None else "yes" if p["efficiency"] >= target else "no"
        load = f"{p['load_1min']:.1f}" if "load_1min" in p else "-"
        others = f"{p['others_cores']:.2f}" if "others_cores" in p else "-"
        floor = _us(p.get("floor_us_per_message"))
        if "floor_switches_per_message" in p:
            floor += f" ({p['floor_switches_per_message']:.1f} switches)"
        lines.append(f"| {p['mode']} | {p['workers']} | {p['elements_per_s']:.0f} | "
                     f"{p['ideal_per_s']:.0f} | {p['efficiency']:.2f} | "
                     f"{'>= ' + str(target) if target else '-'} | {holds} | "
                     f"{_us(p['cpu_us_per_element'])} | "
                     f"{_us(p.get('consumer_us_per_element'))}{_switches(p)} | "
                     f"{_us(p.get('workers_trainer_us_per_element'))} | {floor} | "
                     f"{_ratio(p.get('trainer_over_floor'))} | {load} | {others} |")
    for p in points:
        if p.get("workers") != TARGET_WORKERS or "error" in p:
            continue
        ratio, total = p.get("trainer_over_floor"), p.get("workers_trainer_us_per_element")
        checks = []
        if isinstance(ratio, int | float):
            checks.append(f"trainer / floor {ratio:.1f}x (target <= "
                          f"{TRAINER_OVER_FLOOR_TARGET:g}x: "
                          f"{'holds' if ratio <= TRAINER_OVER_FLOOR_TARGET else 'misses'})")
        if isinstance(total, int | float):
            checks.append(f"workers + trainer {total:.0f} µs per record (target <= "
                          f"{WORKERS_TRAINER_TARGET_US:.0f} µs: "
                          f"{'holds' if total <= WORKERS_TRAINER_TARGET_US else 'misses'})")
        if checks:
            lines += ["", f"At {TARGET_WORKERS} workers, {p['mode']}: " + "; ".join(checks)
                      + "."]
    return lines


def _loads(loads: Any) -> str:
    return ", ".join(f"{value:.2f}" for value in loads)


def jobs_table(jobs: dict[str, Any]) -> list[str]:
    late = jobs["late_first_element_s"]
    lines = [f"Pool of {jobs['pool']} workers, 4 jobs; the 4th started {jobs['late_s']:.0f} s "
             f"after the others and waited {late:.2f} s for its first element."
             if late is not None else "The late job got no element.", "",
             "| job | elements in the window | share | equal share |", "|---|---|---|---|"]
    for job, (count, share) in enumerate(zip(jobs["elements"], jobs["shares"],
                                             strict=True)):
        lines.append(f"| job{job}{' (late)' if job == 3 else ''} | {count} | {share:.2f} "
                     "| 0.25 |")
    lines.append("")
    lines.append(f"Largest deviation from an equal share: {jobs['max_share_error']:.0%} "
                 "(test target: within 20%).")
    if jobs["errors"]:
        lines.append(f"Errors: {'; '.join(jobs['errors'])}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2,4,8,16,32,64",
                        help="worker counts of section 1 (comma-separated)")
    parser.add_argument("--modes", default="embedded,tcp", help="embedded, tcp or both")
    parser.add_argument("--points", action="append",
                        help="instead of --workers and --modes: MODE=W,W... (repeatable), "
                             "e.g. --points embedded=1,8,32,64 --points tcp=8,32")
    parser.add_argument("--element-ms", type=float, default=10.0,
                        help="milliseconds each element waits (default 10)")
    parser.add_argument("--window", type=float, default=5.0, help="seconds counted")
    parser.add_argument("--warmup", type=float, default=2.0,
                        help="seconds after the first element before counting")
    parser.add_argument("--floor-seconds", type=float,
                        help="seconds of the floor measured after each point of section 1 "
                             "(default: --window; 0: no floor)")
    parser.add_argument("--pool", type=int, default=8, help="workers of section 2")
    parser.add_argument("--late", type=float, default=3.0,
                        help="seconds after the first three jobs the fourth starts")
    parser.add_argument("--fleet-workers", type=int, default=1000,
                        help="simulated workers of section 3 (default 1000)")
    parser.add_argument("--fleet-consumers", type=int, default=200,
                        help="simulated consumers of section 3, five to a job (default 200)")
    parser.add_argument("--fleet-seconds", type=float, default=20.0,
                        help="seconds section 3 measures (default 20)")
    parser.add_argument("--fleet-warmup", type=float, default=5.0,
                        help="seconds section 3 runs once the fleet has registered, "
                             "before measuring (default 5)")
    parser.add_argument("--fleet-epoch-every", type=float, default=10.0,
                        help="seconds between a section-3 consumer's EPOCHs (default 10)")
    parser.add_argument("--only", default="scale,jobs", help="scale, jobs, fleet")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--name", default="scale",
                        help="file stem of the results: NAME.json, NAME.md (default scale)")
    parser.add_argument("--note", default="",
                        help="a line to put under the heading of NAME.md (and in the JSON)")
    args = parser.parse_args(argv)
    args.points = parse_points(args.points, args.workers, args.modes)
    if args.floor_seconds is None:
        args.floor_seconds = args.window
    only = set(args.only.split(","))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results: dict[str, Any] = {
        "benchmark": "scale", "date": datetime.datetime.now(datetime.timezone.utc)
        .isoformat(timespec="seconds"), "host": platform.node(), "nproc": os.cpu_count(),
        "python": platform.python_version(), **provenance(),
        "element_ms": args.element_ms, "window_s": args.window,
        "floor_seconds": args.floor_seconds, "load_at_start": os.getloadavg(),
        "note": args.note}
    lines = [f"Scale-out benchmark (bench/scale.py), nproc {os.cpu_count()}, elements of "
             f"{args.element_ms:g} ms of waiting, {args.window:g} s windows, zloader at "
             f"{results['commit'][:12]}. Read efficiencies and ratios, not absolute numbers "
             "(a shared, noisy machine).", *([args.note] if args.note else []), ""]
    if "scale" in only:
        results["scale"] = scale_section(args)
        lines += ["### (1) Throughput against workers", "", *scale_table(results["scale"]),
                  ""]
    if "jobs" in only:
        results["several_jobs"] = jobs_section(args)
        lines += ["### (2) Four jobs on one pool", "", *jobs_table(results["several_jobs"]),
                  ""]
    if "fleet" in only:
        from bench._fleet import fleet_section, fleet_table

        results["fleet"] = fleet_section(args)
        lines += ["### (3) The control plane alone", "", *fleet_table(results["fleet"]), ""]
    leftovers = [p.pid for p in psutil.Process().children(recursive=True)]
    results["children_at_exit"] = leftovers
    results["load_at_end"] = os.getloadavg()
    lines += [f"Load average (1, 5, 15 min): {_loads(results['load_at_start'])} at the "
              f"start, {_loads(results['load_at_end'])} at the end. The load column is the "
              "1-minute figure as each point began (it includes this run's own processes, "
              "the previous point's still in its average); \"others' CPU\" is the cores "
              "that processes outside the run kept busy during the window (/proc/stat less "
              "the run's CPU), the noise to read each row with."]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if leftovers:
        print(f"child processes still running at exit: {leftovers}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
