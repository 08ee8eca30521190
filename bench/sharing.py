"""Sharing benchmark: K trainer processes over one CPU-heavy image pipeline, and a
hyper-parameter sweep whose trainers share a decode and part after it.

    python -m bench.sharing [--images 1024] [--epochs 2] [--workers 2] [--trainers 1,2,4]
        [--sweep-images 512] [--sweep-epochs 2] [--only identical|sweep]

For K in 1, 2, 4 trainer processes, each reading ``epochs`` epochs of ``images`` images
(the [3/7] JPEG pipeline: decode, random resized crop to 224, flip, batches of 64) as fast
as it can, side by side in one run:

- zloader shared: a broker and one ``zloader-worker --processes W``; every trainer is a
  ``Loader(share=True)`` on that broker (the pipeline runs once for all);
- zloader unshared: every trainer an embedded ``Loader`` with W workers of its own;
- torch: every trainer a ``torch.utils.data.DataLoader`` with W workers;
- TensorSocket: one producer process wrapping a torch DataLoader with W workers, and K
  ``TensorConsumer`` trainers.

Reported per system and K: the CPU-seconds the preprocessing side spent per epoch (zloader's
worker processes; the trainers' DataLoader or embedded workers; TensorSocket's producer and
its workers), each trainer's images/s (first batch to last), and the sum over trainers.
Targets ([4/7]): shared CPU at K=4 <= 1.3x that at K=1; each shared trainer's rate >= 0.9x a
lone trainer's; with equal workers, shared zloader's aggregate rate >= TensorSocket's.

The sweep (bench/_sweep.py, [3/6] item 3): four trainers with the same JPEG decode and
their own augmentation and batch size, prefix-shared against four unshared Loaders and four
torch DataLoaders; worker CPU-seconds per epoch, each trainer's epoch seconds, decode calls,
whether each trainer got every image once. Target: the prefix-shared sweep's worker CPU <=
1.4x one trainer's (unshared: about 4x).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import psutil

from bench._common import tree_cpu, version
from bench._images import JPEG_FILES, write_jpegs
from bench._share_trainer import BATCH_SIZE
from bench._sweep import SUFFIXES, photo_files

REPO = pathlib.Path(__file__).resolve().parent.parent
BIN = pathlib.Path(sys.executable).parent
SYSTEMS = ("zloader-shared", "zloader-unshared", "torch", "tensorsocket")
NAMES = {"zloader-shared": "zloader, share=True", "zloader-unshared": "zloader, unshared",
         "torch": "torch DataLoader x K", "tensorsocket": "TensorSocket"}


def free_ports(count: int) -> list[int]:
    import socket

    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def spawn(role: str, config: dict[str, Any]) -> subprocess.Popen[str]:
    path = pathlib.Path(config["workdir"]) / f"config-{role}-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(config))
    return subprocess.Popen([sys.executable, "-m", "bench._share_trainer", role, str(path)],
                            cwd=REPO, stdout=subprocess.PIPE, text=True)


def collect(process: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    out, _ = process.communicate(timeout=timeout)
    if process.returncode != 0:
        raise RuntimeError(f"a benchmark process failed (exit {process.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def start_pool(config: dict[str, Any], service: list[subprocess.Popen[Any]]
               ) -> tuple[dict[str, Any], psutil.Process]:
    """A broker and a ``zloader-worker --processes W`` (into ``service``): the config with
    its address, and the worker process (whose tree's CPU is the workers')."""
    address = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    service.append(subprocess.Popen([BIN / "zloader-broker", "--bind", address,
                                     "--log-level", "warning"]))
    service.append(subprocess.Popen([BIN / "zloader-worker", "--broker", address,
                                     "--processes", str(config["workers"])]))
    time.sleep(1.5)  # the workers register
    return {**config, "broker": address}, psutil.Process(service[1].pid)


def stop_all(service: list[subprocess.Popen[Any]]) -> None:
    for process in service:
        process.terminate()
    for process in service:
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()


def run(system: str, k: int, config: dict[str, Any]) -> dict[str, Any]:
    """One system with K trainers; returns worker-side CPU and each trainer's rate."""
    service: list[subprocess.Popen[Any]] = []
    extra: list[dict[str, Any]] = []
    pool_cpu = 0.0
    try:
        if system == "zloader-shared":
            config, pool = start_pool(config, service)
            pool_cpu = -tree_cpu(pool)
        if system == "tensorsocket":
            config = {**config, "ports": free_ports(4), "trainers": k}
        trainers = [spawn(system, config) for _ in range(k)]
        service += trainers  # stopped in any case (a hung peer must not hang the run)
        if system == "tensorsocket":
            service.append(spawn("tensorsocket-producer", config))
        timeout = config["timeout"]
        results = [collect(t, timeout) for t in trainers]
        if system == "zloader-shared":
            pool_cpu += tree_cpu(pool)
        if system == "tensorsocket":
            extra.append(collect(service[-1], 60))
    finally:
        stop_all(service)
    epochs = config["epochs"]
    rates = []
    for result in results:
        arrivals = result["arrivals"]
        rates.append((len(arrivals) - 1) * BATCH_SIZE / (arrivals[-1] - arrivals[0]))
    if system == "zloader-shared":
        worker_cpu = pool_cpu
    elif system == "tensorsocket":
        worker_cpu = extra[0]["cpu"]["self"] + extra[0]["cpu"]["children"]
    else:
        worker_cpu = sum(r["cpu"]["children"] for r in results)
    return {"system": system, "trainers": k, "worker_cpu_per_epoch": worker_cpu / epochs,
            "trainer_cpu": [r["cpu"]["self"] for r in results], "rates": rates,
            "aggregate": sum(rates), "stats": [r["stats"] for r in results],
            "expected_per_epoch": config["images"] // BATCH_SIZE,
            "share_replayed": [r["stats"].get("share_replayed", 0) for r in results]}


SWEEP = ("one", "zloader-shared", "zloader-unshared", "torch")
SWEEP_NAMES = {"one": "one trainer alone (zloader)", "zloader-shared": "zloader, share=True",
               "zloader-unshared": "zloader, 4 unshared Loaders",
               "torch": "torch DataLoader x 4"}


def run_sweep(system: str, config: dict[str, Any]) -> dict[str, Any]:
    """The sweep's trainers (one alone for ``"one"``) on ``system``: the workers' CPU per
    epoch, each trainer's epoch seconds and exactness, the decode calls per epoch."""
    log = pathlib.Path(config["workdir"]) / f"decodes-{system}.log"
    log.unlink(missing_ok=True)
    config = {**config, "log": str(log), "images": config["sweep_images"],
              "epochs": config["sweep_epochs"]}
    role = "sweep-" + ("zloader-shared" if system == "one" else system)
    service: list[subprocess.Popen[Any]] = []
    pool_cpu = 0.0
    try:
        if role == "sweep-zloader-shared":
            config, pool = start_pool(config, service)
            pool_cpu = -tree_cpu(pool)
        trainers = [spawn(role, {**config, "which": which})
                    for which in range(1 if system == "one" else len(SUFFIXES))]
        service += trainers
        results = [collect(t, config["timeout"]) for t in trainers]
        if role == "sweep-zloader-shared":
            pool_cpu += tree_cpu(pool)
    finally:
        stop_all(service)
    epochs = config["epochs"]
    cpu = pool_cpu if role == "sweep-zloader-shared" else \
        sum(r["cpu"]["children"] for r in results)
    return {"system": system, "worker_cpu_per_epoch": cpu / epochs,
            "seconds": [r["seconds"] for r in results],
            "exact": all(all(r["exact"]) for r in results),
            "replayed": [r["replayed"] for r in results],
            "decodes_per_epoch": log.stat().st_size / epochs if log.exists() else 0.0}


def sweep_table(results: list[dict[str, Any]], images: int) -> str:
    one = next((r for r in results if r["system"] == "one"), None)
    rows = ["| system | worker CPU-s / epoch | vs one trainer | decodes / epoch | each "
            "trainer's epoch, s (batch 32 / 64 / 128 / 256) | every image once |",
            "|---|---|---|---|---|---|"]
    for r in results:
        ratio = (f"{r['worker_cpu_per_epoch'] / one['worker_cpu_per_epoch']:.2f}x"
                 if one else "-")
        epochs = " / ".join(f"{statistics.mean(s):.1f}" for s in r["seconds"])
        rows.append(f"| {SWEEP_NAMES[r['system']]} | {r['worker_cpu_per_epoch']:.2f} | "
                    f"{ratio} | {r['decodes_per_epoch']:.0f} (of {images}) | {epochs} | "
                    f"{'yes' if r['exact'] else 'NO'} |")
    return "\n".join(rows)


def sweep_verdicts(results: list[dict[str, Any]]) -> list[str]:
    by = {r["system"]: r for r in results}
    one, shared = by.get("one"), by.get("zloader-shared")
    out = []
    if one and shared:
        ratio = shared["worker_cpu_per_epoch"] / one["worker_cpu_per_epoch"]
        out.append(f"sweep: prefix-shared worker CPU / one trainer's: {ratio:.2f}x (target "
                   f"<= 1.4x): {'holds' if ratio <= 1.4 else 'missed'}")
    for name in ("zloader-unshared", "torch"):
        if one and name in by:
            out.append(f"sweep: {SWEEP_NAMES[name]} worker CPU / one trainer's: "
                       f"{by[name]['worker_cpu_per_epoch'] / one['worker_cpu_per_epoch']:.2f}x")
    out += [f"sweep: {SWEEP_NAMES[r['system']]}: a trainer did NOT get every image once"
            for r in results if not r["exact"]]
    return out


def table(results: list[dict[str, Any]], ks: list[int]) -> str:
    lone = {r["system"]: statistics.median(r["rates"]) for r in results if r["trainers"] == 1}
    cpu1 = {r["system"]: r["worker_cpu_per_epoch"] for r in results if r["trainers"] == 1}
    rows = ["| system | K | worker CPU-s / epoch | vs K=1 | each trainer, images/s "
            "(min-max) | vs lone trainer | sum over trainers, images/s |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        name, k = r["system"], r["trainers"]
        rows.append(
            f"| {NAMES[name]} | {k} | {r['worker_cpu_per_epoch']:.2f} | "
            f"{r['worker_cpu_per_epoch'] / cpu1[name]:.2f}x | {min(r['rates']):.0f}-"
            f"{max(r['rates']):.0f} | {min(r['rates']) / lone[name]:.2f}x | "
            f"{r['aggregate']:.0f} |")
    return "\n".join(rows)


def verdicts(results: list[dict[str, Any]]) -> list[str]:
    if not results:
        return []
    by = {(r["system"], r["trainers"]): r for r in results}
    top = max(r["trainers"] for r in results)
    out = []
    shared1, shared = by.get(("zloader-shared", 1)), by.get(("zloader-shared", top))
    if shared1 and shared:
        cpu = shared["worker_cpu_per_epoch"] / shared1["worker_cpu_per_epoch"]
        rate = min(shared["rates"]) / statistics.median(shared1["rates"])
        out.append(f"shared CPU-s at K={top} / K=1: {cpu:.2f}x (target <= 1.3x): "
                   f"{'holds' if cpu <= 1.3 else 'missed'}")
        out.append(f"slowest shared trainer at K={top} / lone trainer: {rate:.2f}x "
                   f"(target >= 0.9x): {'holds' if rate >= 0.9 else 'missed'}")
    for k in sorted({r["trainers"] for r in results}):
        ours, theirs = by.get(("zloader-shared", k)), by.get(("tensorsocket", k))
        if ours and theirs:
            ratio = ours["aggregate"] / theirs["aggregate"]
            out.append(f"K={k}: shared zloader's aggregate / TensorSocket's, same workers: "
                       f"{ratio:.2f}x (target >= 1.0x): {'holds' if ratio >= 1 else 'missed'}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1024, help="images per epoch")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2, help="preprocessing processes")
    parser.add_argument("--trainers", default="1,2,4", help="the values of K")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--timeout", type=float, default=120,
                        help="seconds a system's run may take before it counts as failed")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--sweep-images", type=int, default=512,
                        help="images per epoch of the sweep")
    parser.add_argument("--sweep-epochs", type=int, default=2)
    parser.add_argument("--only", choices=("identical", "sweep"), default=None,
                        help="run one of the two sections only")
    args = parser.parse_args()
    ks = [int(k) for k in args.trainers.split(",")]
    systems = args.systems.split(",")
    if args.images < 2 * BATCH_SIZE or args.images % BATCH_SIZE or set(systems) - set(SYSTEMS):
        parser.error(f"--images must be a multiple of {BATCH_SIZE} (at least two batches); "
                     f"--systems among {SYSTEMS}")
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="bench-sharing-"))
    results: list[dict[str, Any]] = []
    swept: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    try:
        paths = write_jpegs(workdir, JPEG_FILES)
        config = {"paths": paths, "images": args.images, "epochs": args.epochs,
                  "workers": args.workers, "workdir": str(workdir),
                  "timeout": args.timeout, "sweep_images": args.sweep_images,
                  "sweep_epochs": args.sweep_epochs}
        if args.only != "identical":
            swept = sweep(config, workdir, failed)
        for k in ks if args.only != "sweep" else ():
            for system in systems:
                if system in failed:
                    continue
                result = attempt(functools.partial(run, system, k, config), system,
                                 f"[K={k}] {NAMES[system]}", failed, f"K={k}: ")
                if result is not None:
                    results.append(result)
                    print(f"{result['worker_cpu_per_epoch']:.2f} CPU-s per epoch, trainers "
                          f"{', '.join(f'{r:.0f}' for r in result['rates'])} images/s",
                          file=sys.stderr)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    head = (f"Sharing benchmark: {args.images} images per epoch, {args.epochs} epochs, "
            f"{args.workers} preprocessing processes per system (per trainer for the "
            f"unshared systems), nproc {os.cpu_count()}, torch {version('torch')}, "
            f"tensorsocket {version('tensorsocket')}. One run per cell; the machine is "
            "shared and noisy, read the ratios.")
    notes = [f"- {v}" for v in verdicts(results) + sweep_verdicts(swept)]
    for r in results:
        counts = [c for s in r["stats"] for c in s.get("batches_per_epoch", [])]
        if counts and min(counts) < r["expected_per_epoch"]:
            notes.append(f"- {NAMES[r['system']]}, K={r['trainers']}: trainers received "
                         f"{min(counts)}-{max(counts)} of the {r['expected_per_epoch']} batches "
                         "of an epoch (its producer broadcasts groups of 8 loader batches and "
                         "drops the last group at the end of an epoch); rates count what "
                         "arrived")
    notes += [f"- {NAMES.get(name, name)} did not complete ({why}); its other rows are "
              "missing" for name, why in failed.items()]
    sections = [head]
    if results:
        sections.append(table(results, ks))
    if swept:
        sections += [f"The sweep: {args.sweep_images} images per epoch (real photographs), "
                     f"{args.sweep_epochs} epochs, {args.workers} preprocessing processes "
                     "per system (per trainer for the unshared ones); four trainers with "
                     "the same decode, batch sizes 32 / 64 / 128 / 256, augmentation "
                     "strengths 0.1 / 0.4 / 0.1 / 0.4.",
                     sweep_table(swept, args.sweep_images)]
    text = "\n\n".join([*sections, "\n".join(notes)])
    print(text)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sharing.md").write_text(text + "\n")
    (out / "sharing.json").write_text(json.dumps({"identical": results, "sweep": swept},
                                                 indent=1) + "\n")


def sweep(config: dict[str, Any], workdir: pathlib.Path,
          failed: dict[str, str]) -> list[dict[str, Any]]:
    """The sweep's systems, one after another (see bench/_sweep.py)."""
    config = {**config, "paths": photo_files(workdir, 64)}
    out = []
    for system in SWEEP:
        result = attempt(functools.partial(run_sweep, system, config), f"sweep {system}",
                         f"[sweep] {SWEEP_NAMES[system]}", failed)
        if result is not None:
            out.append(result)
            print(f"{result['worker_cpu_per_epoch']:.2f} CPU-s per epoch, "
                  f"{result['decodes_per_epoch']:.0f} decodes per epoch, exact "
                  f"{result['exact']}", file=sys.stderr)
    return out


def attempt(run_one: Callable[[], dict[str, Any]], key: str, label: str,
            failed: dict[str, str], prefix: str = "") -> dict[str, Any] | None:
    """One system's run: its result, or None with why it failed noted in ``failed``
    (under ``key``); prints ``label``, the seconds it took, and leaves the line open for
    the caller's figures."""
    started = time.perf_counter()
    try:
        result = run_one()
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        failed[key] = f"{prefix}{type(exc).__name__}: {str(exc)[:200]}"
        print(f"{label} failed: {failed[key]}", file=sys.stderr, flush=True)
        return None
    print(f"{label} ({time.perf_counter() - started:.1f} s): ", end="", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
