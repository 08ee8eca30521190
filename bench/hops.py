"""What one hop of a record costs on this machine, the floor under zloader's record path.

A record crosses, in order: the worker's producer thread to its socket thread, a DATA
notice from the worker process to the consumer's (ZeroMQ over ipc, through both sides'
ZeroMQ I/O threads), and the consumer's I/O thread to the iterating thread (a queue);
a CREDIT goes back every few records. Each hop wakes a thread. This measures, with
nothing of zloader's in the way:

- **process hop**: a message between two processes over a ZeroMQ ``ipc://`` PAIR, ping-pong;
  CPU of both processes (user + system, ZeroMQ's I/O threads included) per one-way message;
- **thread hop**: a handoff between two threads of one process through ``queue.Queue``,
  ping-pong; CPU of the process per one-way handoff;
- **paced receiver** (the floor bench.scale sets beside each of its points): a bare Python
  process woken once per message, a ZeroMQ PULL over ``ipc://`` fed by a PUSH in another
  process one small message at a time, paced at a given rate; CPU (user + system, its
  ZeroMQ I/O thread included) and context switches of the receiving process per message.
  The least a consumer of one record per message can spend at that rate;
- **Python speed**: CPU of an empty ``for`` loop of a million turns (a rough scale of
  this host's Python speed against others).

``python -m bench.hops [--messages N] [--rate R] [--out DIR]`` writes ``hops.json`` and
``hops.md``.
Compare the hops of one record (about three, plus a share of a CREDIT) with bench.scale's
CPU per element: what is above them is Python work per record.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import queue
import resource
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import psutil
import zmq

from bench._common import provenance, stop, tree_cpu


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def echo(address: str, messages: int) -> None:
    """The other process: answer ``messages`` messages (and the warm-up one), then wait
    for the word to exit (its CPU is read while it still runs)."""
    context = zmq.Context()
    pair = context.socket(zmq.PAIR)
    pair.connect(address)
    for _ in range(messages + 1):
        pair.send(pair.recv())
    pair.recv()
    pair.close(0)
    context.term()


def pull(address: str, messages: int, warm: int) -> None:
    """The paced receiver's process: connect a PULL to ``address``, take ``warm``
    messages, then ``messages`` more, one ``recv`` each, and print on stdout, as JSON, what
    the second lot cost this process (every thread of it, ZeroMQ's included)."""
    context = zmq.Context()
    sink = context.socket(zmq.PULL)
    sink.connect(address)
    for _ in range(warm):
        sink.recv()
    before, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(messages):
        sink.recv()
    wall = time.perf_counter() - wall
    after = resource.getrusage(resource.RUSAGE_SELF)
    sink.close(0)
    context.term()
    print(json.dumps({
        "messages": messages, "seconds": wall,
        "cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
        "voluntary": after.ru_nvcsw - before.ru_nvcsw,
        "involuntary": after.ru_nivcsw - before.ru_nivcsw}), flush=True)


def paced_floor(rate: float, seconds: float, message_bytes: int = 16) -> dict[str, float]:
    """A receiver process woken once per message at ``rate`` messages per second for
    ``seconds`` (after half a second, or 20 messages, of warm-up): its CPU and context
    switches per message, and the rate it got (the sender sleeps until each message is
    due; one that falls behind sends at once until it has caught up).

    Raises:
        RuntimeError: the receiver failed or did not report within its deadline.
    """
    rate = max(1.0, float(rate))
    warm = max(20, int(rate / 2))
    messages = max(20, int(rate * seconds))
    payload = b"x" * message_bytes
    with tempfile.TemporaryDirectory() as where:
        context = zmq.Context()
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDTIMEO, 30_000)  # a receiver that never came: zmq.Again
        push.bind(f"ipc://{where}/floor")
        child = subprocess.Popen(
            [sys.executable, "-m", "bench.hops", "--pull", f"ipc://{where}/floor",
             "--messages", str(messages), "--warm", str(warm)], stdout=subprocess.PIPE)
        try:
            push.send(payload)  # blocks until the receiver has connected
            start = time.perf_counter()
            for i in range(1, warm + messages):
                delay = start + i / rate - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                push.send(payload)
            out, _ = child.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the paced receiver did not report within 60 s of its last "
                               f"message ({messages} at {rate:.0f}/s)") from None
        finally:
            stop([child], 10)
            push.close(0)
            context.term()
    if child.returncode != 0 or not out:
        raise RuntimeError(f"the paced receiver exited with {child.returncode} and no result")
    got = json.loads(out)
    count = got["messages"]
    return {"rate": rate, "achieved_rate": count / got["seconds"], "messages": count,
            "cpu_us": got["cpu_s"] / count * 1e6,
            "switches": (got["voluntary"] + got["involuntary"]) / count,
            "voluntary": got["voluntary"] / count, "involuntary": got["involuntary"] / count}


def process_hop(messages: int) -> dict[str, float]:
    """Ping-pong over ipc with a child process; CPU per one-way message."""
    with tempfile.TemporaryDirectory() as where:
        address = f"ipc://{where}/hop"
        context = zmq.Context()
        pair = context.socket(zmq.PAIR)
        pair.bind(address)
        child = subprocess.Popen([sys.executable, "-m", "bench.hops", "--echo", address,
                                  "--messages", str(messages)])
        try:
            pair.send(b"x")
            pair.recv()  # (the child has started: its start-up is not counted below)
            child_cpu = tree_cpu(psutil.Process(child.pid))
            mine, wall = _cpu(resource.RUSAGE_SELF), time.perf_counter()
            for _ in range(messages):
                pair.send(b"x")
                pair.recv()
            wall = time.perf_counter() - wall
            mine = _cpu(resource.RUSAGE_SELF) - mine
            child_cpu = tree_cpu(psutil.Process(child.pid)) - child_cpu
            pair.send(b"exit")
        finally:
            stop([child], 30)
            pair.close(0)
            context.term()
    hops = 2 * messages
    return {"wall_us": wall / hops * 1e6, "cpu_us": (mine + child_cpu) / hops * 1e6,
            "this_side_cpu_us": mine / hops * 1e6}


def thread_hop(messages: int) -> dict[str, float]:
    """Ping-pong through two queue.Queue between two threads; CPU per handoff."""
    there: queue.Queue[int] = queue.Queue()
    back: queue.Queue[int] = queue.Queue()

    def answer() -> None:
        for _ in range(messages):
            back.put(there.get())

    helper = threading.Thread(target=answer, daemon=True)
    helper.start()
    cpu, wall = _cpu(resource.RUSAGE_SELF), time.perf_counter()
    for i in range(messages):
        there.put(i)
        back.get()
    wall = time.perf_counter() - wall
    cpu = _cpu(resource.RUSAGE_SELF) - cpu
    helper.join(30)
    return {"wall_us": wall / (2 * messages) * 1e6, "cpu_us": cpu / (2 * messages) * 1e6}


def python_speed() -> dict[str, float]:
    """CPU milliseconds of an empty loop of a million turns."""
    cpu = time.thread_time()
    for _ in range(1_000_000):
        pass
    return {"loop_ms": (time.thread_time() - cpu) * 1e3}


def median(measure: Any, args: argparse.Namespace) -> dict[str, float]:
    """The run of ``measure(messages)`` with the median CPU (or loop time) of
    ``args.repeats`` runs: a shared machine's hops vary from one minute to the next."""
    runs = [measure(args.messages) for _ in range(max(1, args.repeats))]
    runs.sort(key=lambda run: run.get("cpu_us", run.get("loop_ms", 0.0)))
    chosen = dict(runs[len(runs) // 2])
    chosen["runs_cpu"] = [round(r.get("cpu_us", r.get("loop_ms", 0.0)), 1) for r in runs]
    return chosen


def table(results: dict[str, Any]) -> list[str]:
    process, thread = results["process_hop"], results["thread_hop"]
    floor = results.get("paced_floor")
    return [
        "| hop | CPU per hop | wall per hop | notes |", "|---|---|---|---|",
        f"| process to process (ZeroMQ ipc) | {process['cpu_us']:.0f} µs | "
        f"{process['wall_us']:.0f} µs | both processes, their ZeroMQ I/O threads "
        f"included ({process['this_side_cpu_us']:.0f} µs on the sending side); runs: "
        f"{_runs(process)} |",
        f"| thread to thread (queue.Queue) | {thread['cpu_us']:.0f} µs | "
        f"{thread['wall_us']:.0f} µs | one process; runs: {_runs(thread)} |",
        *([f"| paced receiver (ZeroMQ PUSH/PULL ipc, {floor['rate']:.0f}/s asked, "
           f"{floor['achieved_rate']:.0f}/s got) | {floor['cpu_us']:.0f} µs | | the "
           f"receiving process alone, woken {floor['switches']:.1f} times per message; "
           f"runs: {_runs(floor)} |"] if floor else []),
        f"| (an empty Python loop of 1M turns) | {results['python_loop']['loop_ms']:.0f} ms | | "
        "this host's Python speed |"]


def _runs(hop: dict[str, Any]) -> str:
    return ", ".join(f"{v:.0f}" for v in hop.get("runs_cpu", [])) + " µs"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=5000,
                        help="round trips per measurement (default 5000)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="measurements of each, the median reported (default 3)")
    parser.add_argument("--out", default="bench/results", help="where to write results")
    parser.add_argument("--rate", type=float, default=800.0,
                        help="messages per second of the paced receiver (default 800: "
                             "bench.scale's ideal at 8 workers)")
    parser.add_argument("--seconds", type=float, default=3.0,
                        help="seconds of each paced-receiver measurement (default 3)")
    parser.add_argument("--echo", help=argparse.SUPPRESS)  # the child process's side
    parser.add_argument("--pull", help=argparse.SUPPRESS)  # the paced receiver's side
    parser.add_argument("--warm", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.echo:
        echo(args.echo, args.messages)
        return 0
    if args.pull:
        pull(args.pull, args.messages, args.warm)
        return 0
    results: dict[str, Any] = {
        "benchmark": "hops",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "nproc": os.cpu_count(), "python": platform.python_version(),
        **provenance(), "messages": args.messages, "repeats": args.repeats,
        "process_hop": median(process_hop, args), "thread_hop": median(thread_hop, args),
        "paced_floor": median(lambda _: paced_floor(args.rate, args.seconds), args),
        "python_loop": median(lambda _: python_speed(), args)}
    lines = [f"Hop costs (bench/hops.py), nproc {os.cpu_count()}, {args.messages} round "
             f"trips each, the median of {args.repeats} runs. The floor under the record "
             "path: a record makes about three hops (producer to socket thread, worker to "
             "consumer, I/O thread to iterating thread) and a share of a CREDIT's.", "",
             *table(results)]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hops.json").write_text(json.dumps(results, indent=1))
    (out / "hops.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
