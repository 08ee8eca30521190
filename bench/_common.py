"""Helpers shared by the benchmarks."""

from __future__ import annotations

import importlib.metadata
import json
import pathlib
import signal
import socket
import subprocess
from typing import Any

import psutil

REPO = pathlib.Path(__file__).resolve().parent.parent


def version(distribution: str) -> str:
    """An installed distribution's version, or "not installed"."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def provenance() -> dict[str, Any]:
    """The commit the tree was at and its uncommitted files under zloader/ (zloader is
    installed in editable mode, so the working tree is what ran); "unknown" and none
    where git or the repository is missing (a copy of the tree on another host)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                  timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"commit": git("rev-parse", "HEAD").strip() or "unknown",
            "uncommitted": git("status", "--porcelain", "--", "zloader").splitlines()}


def write_results(out: str, stem: str, data: Any, lines: list[str]) -> None:
    """Write ``data`` to ``out/stem.json`` and its tables (``lines``) to ``out/stem.md``,
    and print the tables."""
    folder = pathlib.Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.json").write_text(json.dumps(data, indent=1))
    text = "\n".join(lines)
    (folder / f"{stem}.md").write_text(text + "\n")
    print(text)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop(processes: list[subprocess.Popen[Any]], timeout: float) -> None:
    """SIGTERM each process in turn; kill one still running after ``timeout`` seconds."""
    for process in processes:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def join_or_kill(processes: list[Any], timeout: float) -> None:
    """Join each ``multiprocessing`` process in turn; kill one still running after
    ``timeout`` seconds."""
    for process in processes:
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()


def tree_cpu(*roots: psutil.Process) -> float:
    """CPU seconds (user + system) ``roots`` and all their descendants have used so far,
    each process counted once; processes that have exited count for nothing."""
    total = 0.0
    seen: set[int] = set()
    for root in roots:
        try:
            family = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for process in family:
            if process.pid in seen:
                continue
            seen.add(process.pid)
            try:
                times = process.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
    return total
