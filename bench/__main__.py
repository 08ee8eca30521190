"""``python -m bench`` (``make bench``): every benchmark bench/catalog.py marks for it, in
its order, each in a process of its own, then ``bench.report``. A benchmark that fails is
named at the end and does not stop the others."""

from __future__ import annotations

import subprocess
import sys

from bench.catalog import BENCHMARKS


def main() -> int:
    failed = []
    for bench in (b for b in BENCHMARKS if b.in_make):
        print(f"== python -m bench.{bench.module}", flush=True)
        if subprocess.run([sys.executable, "-m", f"bench.{bench.module}"]).returncode:
            failed.append(bench.module)
    report = subprocess.run([sys.executable, "-m", "bench.report"]).returncode
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed or report else 0


if __name__ == "__main__":
    sys.exit(main())
