"""Where a record's CPU goes: every thread of a Loader's processes, grouped by role.

A Loader with ``--workers`` embedded workers (default 8) reads
``Pipeline.range(10**9).map(wait)``, each element waiting ``--element-ms`` (default 10 ms)
and going alone in its record (it takes longer than the producer's RECORD_LINGER). After
``--warmup`` seconds (default 2), over ``--window`` seconds (default 6), this reads every
thread's user and system CPU (``/proc/<pid>/task/<tid>/stat``) and voluntary and
involuntary context switches (``.../status``) in the trainer's process and in each worker
process, and groups the threads by role:

- trainer: the iterating thread (this process's main thread), the Loader's I/O thread
  (``zloader-loader-io``), the embedded broker's thread (``zloader-broker``), ZeroMQ's
  threads (``ZMQbg/IO/n``, ``ZMQbg/Reaper``), other threads;
- workers: their main threads (the WorkerProcess loop), producer threads
  (``zloader-producer-<epoch>``), ZeroMQ's threads, other threads;
- other child processes (none, usually).

Each role's figures are per element: CPU µs (user + system), and switches. Python 3.11
does not give its threads' names to the kernel, so before the Loader forks its workers this
makes every ``threading.Thread`` set its kernel name (``prctl(PR_SET_NAME)``, 15
characters: ``zloader-loader-``, ``zloader-produce``) as it starts: a change to this
process only, inherited by the forked workers, that zloader never sees. Threads that end
during the window are lost to the per-thread figures; the "whole process" rows read
``/proc/<pid>/stat``, which keeps them, so the gap between the two shows it.

Each round is a fresh Loader; the round reported is the median of ``--rounds`` (default 3)
by total CPU per element, with every round's totals beside it. ``/proc`` counts CPU in
clock ticks (usually 10 ms): over a window of thousands of elements, a few µs per element.

``python -m bench.profile [--workers 8] [--window 6] [--warmup 2] [--rounds 3]
[--exactly-once on|off] [--out bench/results/profile.json]`` writes the JSON to ``--out``
and the markdown table next to it (same stem, ``.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import os
import pathlib
import platform
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psutil

from bench._common import provenance
from bench.scale import pipeline

TICK = os.sysconf("SC_CLK_TCK")
PR_SET_NAME = 15
TRAINER_ROLES = ("iterating thread", "I/O thread (zloader-loader-io)",
                 "broker thread (zloader-broker)", "ZeroMQ threads (ZMQbg/*)", "other threads")
WORKER_ROLES = ("main threads", "producer threads (zloader-producer-*)",
                "ZeroMQ threads (ZMQbg/*)", "other threads")
FIGURES = ("user_s", "system_s", "voluntary", "involuntary")


@dataclass(frozen=True)
class Sample:
    """One thread's counters at one moment."""

    pid: int
    tid: int
    comm: str
    user_s: float
    system_s: float
    voluntary: int
    involuntary: int


@contextlib.contextmanager
def named_threads() -> Iterator[None]:
    """While open, every ``threading.Thread`` started in this process, and in the processes
    it forks, gives its name to the kernel (``/proc/.../comm``) as it starts."""
    libc = ctypes.CDLL(None, use_errno=True)
    original = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def bootstrap(self: threading.Thread) -> None:
        with contextlib.suppress(Exception):
            libc.prctl(PR_SET_NAME, self.name.encode()[:15], 0, 0, 0)
        original(self)

    threading.Thread._bootstrap_inner = bootstrap  # type: ignore[attr-defined]
    try:
        yield
    finally:
        threading.Thread._bootstrap_inner = original  # type: ignore[attr-defined]


def read_thread(pid: int, tid: int) -> Sample | None:
    """``tid``'s counters, or None when it (or its process) has ended."""
    where = f"/proc/{pid}/task/{tid}"
    try:
        with open(f"{where}/stat") as f:
            stat = f.read()
        with open(f"{where}/status") as f:
            status = f.read()
        with open(f"{where}/comm") as f:
            comm = f.read().strip()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # fields from the 3rd (state) on
    switches = {key: int(value) for key, _, value in
                (line.partition(":\t") for line in status.splitlines())
                if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")}
    return Sample(pid, tid, comm, int(fields[11]) / TICK, int(fields[12]) / TICK,
                  switches.get("voluntary_ctxt_switches", 0),
                  switches.get("nonvoluntary_ctxt_switches", 0))


def process_cpu(pid: int) -> float:
    """CPU seconds of process ``pid`` (ended threads included), 0 when it has ended."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def snapshot(pids: list[int], me_last: bool) -> dict[tuple[int, int], Sample]:
    """Every thread of ``pids``; this thread read last (window start) or first (end), so
    that reading the others counts outside the window."""
    me = (os.getpid(), threading.get_native_id())
    order = [(pid, tid) for pid in pids for tid in _tids(pid) if (pid, tid) != me]
    order = [*order, me] if me_last else [me, *order]
    samples = {}
    for pid, tid in order:
        sample = read_thread(pid, tid)
        if sample is not None:
            samples[pid, tid] = sample
    return samples


def _tids(pid: int) -> list[int]:
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return []


def role(kind: str, sample: Sample) -> str:
    """A thread's role from its process's kind and its kernel name."""
    if kind == "other":
        return "other processes"
    zmq = sample.comm.startswith("ZMQbg/")
    if kind == "trainer":
        if sample.tid == sample.pid:
            return TRAINER_ROLES[0]
        if sample.comm.startswith("zloader-loader"):
            return TRAINER_ROLES[1]
        if sample.comm == "zloader-broker":
            return TRAINER_ROLES[2]
        return TRAINER_ROLES[3] if zmq else TRAINER_ROLES[4]
    if sample.tid == sample.pid:
        return WORKER_ROLES[0]
    if sample.comm.startswith("zloader-produc"):
        return WORKER_ROLES[1]
    return WORKER_ROLES[2] if zmq else WORKER_ROLES[3]


def one_round(args: argparse.Namespace) -> dict[str, Any]:
    """A fresh Loader, its warm-up, then every thread's counters over the window."""
    import zloader

    load = os.getloadavg()[0]
    me = psutil.Process()
    with zloader.Loader(pipeline(args.element_ms), num_workers=args.workers, timeout=60,
                        exactly_once=args.exactly_once == "on") as loader:
        elements = iter(loader)
        next(elements)
        warm = time.perf_counter()
        while time.perf_counter() - warm < args.warmup:
            next(elements)

        def kinds() -> dict[int, str]:
            workers = set(loader.stats()["per_worker"])
            return {me.pid: "trainer", **{child.pid: "worker" if child.pid in workers
                                          else "other" for child in me.children()}}

        kind = kinds()
        records0, cpu0 = loader.stats()["records"], {p: process_cpu(p) for p in kind}
        before = snapshot(list(kind), me_last=True)
        start, count = time.perf_counter(), 0
        while True:
            next(elements)
            count += 1
            if time.perf_counter() - start >= args.window:
                break
        seconds = time.perf_counter() - start
        kind = {**kinds(), **kind}  # a worker that came in the window: its threads count
        after = snapshot(list(kind), me_last=False)
        cpu = {p: max(0.0, process_cpu(p) - cpu0[p]) for p in cpu0}
        records = loader.stats()["records"] - records0
    return tabulate(args, kind, before, after, count, records, seconds, load, cpu)


def tabulate(args: argparse.Namespace, kind: dict[int, str],
             before: dict[tuple[int, int], Sample], after: dict[tuple[int, int], Sample],
             elements: int, records: int, seconds: float, load: float,
             process_cpu_s: dict[int, float]) -> dict[str, Any]:
    """One round's figures per element, by role, with totals and each thread's."""
    per = max(1, elements)
    order = [("trainer", r) for r in TRAINER_ROLES] + [("workers", r) for r in WORKER_ROLES]
    # Every role has its row, threads or not, so that tables of two runs line up.
    roles = {key: {"threads": 0, **dict.fromkeys(FIGURES, 0.0)} for key in order}
    threads = []
    for key, end in after.items():
        begin = before.get(key)  # a thread started in the window counts from zero
        delta = {f: getattr(end, f) - (getattr(begin, f) if begin else 0) for f in FIGURES}
        process = {"trainer": "trainer", "worker": "workers"}.get(kind.get(end.pid, ""),
                                                                  "other")
        name = role(kind.get(end.pid, "other"), end)
        total = roles.setdefault((process, name),
                                 {"threads": 0, **dict.fromkeys(FIGURES, 0.0)})
        total["threads"] += 1
        for f in FIGURES:
            total[f] += delta[f]
        threads.append({"process": process, "pid": end.pid, "tid": end.tid, "comm": end.comm,
                        "role": name, **_per_element(delta, per)})
    rows: list[dict[str, Any]] = [
        {"process": process, "role": name, "threads": int(total["threads"]),
         **_per_element(total, per)} for (process, name), total in roles.items()]
    rows.sort(key=lambda r: order.index((r["process"], r["role"]))
              if (r["process"], r["role"]) in order else len(order))
    totals = {}
    for process in ("trainer", "workers", "all"):
        mine = [r for r in rows if process in ("all", r["process"])]
        totals[process] = {"threads": sum(r["threads"] for r in mine),
                           **{f: sum(r[f] for r in mine) for f in _per_element({}, 1)}}
    whole = {"trainer": sum(v for p, v in process_cpu_s.items() if kind[p] == "trainer"),
             "workers": sum(v for p, v in process_cpu_s.items() if kind[p] == "worker")}
    ideal = args.workers * 1000 / args.element_ms
    return {"elements": elements, "records": records, "seconds": seconds,
            "elements_per_s": elements / seconds, "efficiency": elements / seconds / ideal,
            "load_1min": load, "roles": rows, "totals": totals,
            "whole_process_cpu_us": {k: v / per * 1e6 for k, v in whole.items()},
            "threads_gone": sum(1 for key in before if key not in after),
            "threads": sorted(threads, key=lambda t: -t["cpu_us"])}


def _per_element(counts: dict[str, float], per: int) -> dict[str, float]:
    """Counter deltas as figures per element (µs and switches)."""
    user, system = counts.get("user_s", 0.0), counts.get("system_s", 0.0)
    return {"cpu_us": (user + system) / per * 1e6, "user_us": user / per * 1e6,
            "system_us": system / per * 1e6,
            "voluntary": counts.get("voluntary", 0) / per,
            "involuntary": counts.get("involuntary", 0) / per,
            "switches": (counts.get("voluntary", 0) + counts.get("involuntary", 0)) / per}


def markdown(results: dict[str, Any]) -> list[str]:
    """The chosen round as a table by role, with the totals and every round's totals."""
    chosen = results["rounds"][results["median_round"]]
    lines = [f"Per-thread profile (bench/profile.py): {results['workers']} embedded workers, "
             f"Pipeline.range(10**9).map(sleep {results['element_ms']:g} ms), one element "
             f"per record ({chosen['records']} records for {chosen['elements']} elements), "
             f"exactly_once {results['exactly_once']}; {results['window_s']:g} s window "
             f"after {results['warmup_s']:g} s of warm-up; the median of "
             f"{len(results['rounds'])} rounds by total CPU per element (round "
             f"{results['median_round'] + 1}: {chosen['elements_per_s']:.0f} elements/s, "
             f"efficiency {chosen['efficiency']:.2f}, load {chosen['load_1min']:.1f}). "
             f"nproc {results['nproc']}, zloader at {results['commit'][:12]}.",
             *([results["note"]] if results.get("note") else []), "",
             "| process | role | threads | CPU µs / element | user | system | "
             "switches / element | voluntary | involuntary |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in chosen["roles"]:
        lines.append(_row(row["process"], row["role"], row))
    for process, label in (("trainer", "**trainer, all threads**"),
                           ("workers", "**workers, all threads**"), ("all", "**all**")):
        lines.append(_row("" if process == "all" else process, label,
                          chosen["totals"][process]))
    whole = chosen["whole_process_cpu_us"]
    lines += ["", f"Whole processes (/proc/<pid>/stat, ended threads included): trainer "
              f"{whole['trainer']:.0f} µs, workers {whole['workers']:.0f} µs per element "
              f"({chosen['threads_gone']} threads ended in the window).",
              "Rounds (CPU µs per element, all / trainer / workers; switches per element): "
              + "; ".join(f"{r['totals']['all']['cpu_us']:.0f} / "
                          f"{r['totals']['trainer']['cpu_us']:.0f} / "
                          f"{r['totals']['workers']['cpu_us']:.0f}; "
                          f"{r['totals']['all']['switches']:.1f}"
                          for r in results["rounds"]) + "."]
    return lines


def _row(process: str, name: str, figures: dict[str, Any]) -> str:
    return (f"| {process} | {name} | {figures['threads']} | {figures['cpu_us']:.1f} | "
            f"{figures['user_us']:.1f} | {figures['system_us']:.1f} | "
            f"{figures['switches']:.2f} | {figures['voluntary']:.2f} | "
            f"{figures['involuntary']:.2f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8, help="embedded workers (default 8)")
    parser.add_argument("--element-ms", type=float, default=10.0,
                        help="milliseconds each element waits (default 10)")
    parser.add_argument("--window", type=float, default=6.0,
                        help="seconds measured (default 6)")
    parser.add_argument("--warmup", type=float, default=2.0,
                        help="seconds after the first element before measuring (default 2)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds, each a fresh Loader; the median reported (default 3)")
    parser.add_argument("--exactly-once", choices=("on", "off"), default="on",
                        help="the Loader's exactly_once (default on, as the Loader's)")
    parser.add_argument("--out", default="bench/results/profile.json",
                        help="the JSON file; the markdown goes next to it (.md)")
    parser.add_argument("--note", default="", help="a line to put under the heading")
    args = parser.parse_args(argv)
    with named_threads():
        rounds = [one_round(args) for _ in range(max(1, args.rounds))]
    by_cpu = sorted(range(len(rounds)), key=lambda i: rounds[i]["totals"]["all"]["cpu_us"])
    results: dict[str, Any] = {
        "benchmark": "profile",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "nproc": os.cpu_count(), "python": platform.python_version(),
        **provenance(), "workers": args.workers, "element_ms": args.element_ms,
        "window_s": args.window, "warmup_s": args.warmup, "exactly_once": args.exactly_once,
        "note": args.note, "median_round": by_cpu[len(by_cpu) // 2], "rounds": rounds}
    lines = markdown(results)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
