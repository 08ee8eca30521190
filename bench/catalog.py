"""The benchmarks, in one list: what each measures, its targets, how long it runs, and
whether ``make bench`` runs it.

    python -m bench.catalog            # print bench/README.md from this list
    python -m bench.catalog --write    # write it (tests/test_report.py checks it is current)

``python -m bench`` runs the ones marked ``in_make`` (``make bench``), then
``bench.report``; ``bench/report.py`` titles each result file with its entry here.
Durations are on the 2-core development machine, with the defaults.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BENCHMARKS", "Benchmark", "readme"]


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: ``python -m bench.<module>``, writing ``<module>.json`` and ``.md``
    into bench/results/ (``results``: the stems it writes, when not just its name;
    ``reported``: False for one that only prints)."""

    module: str
    title: str
    measures: str
    targets: str
    minutes: str
    in_make: bool = True
    results: tuple[str, ...] = ()
    reported: bool = True

    @property
    def stems(self) -> tuple[str, ...]:
        """The stems of the result files it writes."""
        if not self.reported:
            return ()
        return self.results or (self.module,)


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("codec", "Codec",
              "a round trip (encode, one block, decode) of three element shapes: zloader's "
              "codec against pickle 5 with out-of-band buffers and plain pickle",
              "none (reference for the record path)", "1"),
    Benchmark("transport", "Transport: zloader against other loaders",
              "(a) 9.6 MB batches locally, (b) over TCP, (c) small elements, (d) time to "
              "first element, (e) CURVE keys against none, (f, g) exactly-once on and off, "
              "(h) fresh batches against memory speed; against torch's DataLoader, raw "
              "ZeroMQ and the tf.data service",
              "(a) >= 8x torch; (b) >= 0.8x raw ZeroMQ, >= 2.5x the tf.data service; "
              "(c) >= 250,000/s, >= 12x torch, >= 50x the tf.data service; (d) <= 1 s; "
              "(h) >= 0.75x memory speed, >= 5x torch", "3"),
    Benchmark("torch_loader", "zloader.torch.DataLoader against torch DataLoader",
              "images/s and CPU per image of a JPEG pipeline, batches/s of in-memory "
              "tensors, time to the first batch and to a second epoch's: the drop-in "
              "against torch's DataLoader with the same arguments",
              "images/s >= 0.95x torch, CPU per image < torch's; tensors >= 3x torch; "
              "first batch <= 2 s; a persistent second epoch's first batch <= torch's",
              "2"),
    Benchmark("big_dataset", "An ImageNet-sized dataset: construction to first batch",
              "construction to the first batch of 256 over 1.28 M (path, class) pairs: torch, "
              "the drop-in, a Loader embedded and through a broker (its pipeline fetches)",
              "none checked; bench.report reads the embedded Loader against <= 3 s", "1"),
    Benchmark("memory", "Memory: what forked workers copy, their base, rings and epochs",
              "the USS 8 forked workers add over an epoch of 3 M pairs and of 1 M dicts "
              "(copy on read), a worker's base, rings and PSS at 8-64 workers, RSS over "
              "20 epochs; torch against zloader.torch",
              "workers copy <= 0.1 of the dataset; a worker's base <= 2x torch's; worker "
              "RSS within 5% of epoch 2's", "6"),
    Benchmark("startup", "Start-up: construction to first batch against torch DataLoader",
              "construction to the first batch for 10,000, 1 M, 3 M and 200,000-sample "
              "datasets, a second epoch, first batch against size; import time, a warm "
              "pool, the trainer's CPU per batch; import and first batch in a fresh "
              "process; the 1st, 3rd, 10th and 50th batch",
              "no later than torch in every case, 1 M and 3 M within 1.2x of the small "
              "one; import <= numpy's + 100 ms; warm pool: first element <= 50 ms "
              "(known pipeline), <= 100 ms (new), a 200-element job <= 2x its first "
              "element; trainer CPU <= 0.5x torch", "2"),
    Benchmark("native", "The compiled core against its pure-Python twins",
              "bench.transport's (c) small elements and (g) shuffled batches, exactly-once "
              "on and off, (a) 9.6 MB batches, and bench.scale's lone record (8 embedded "
              "workers, 10 ms elements), each in fresh processes with the compiled core "
              "and with ZLOADER_PURE=1, interleaved; CPU per element and per record",
              "exactly-once on / off >= 0.9 in (g); workers + trainer <= 150 µs per lone "
              "record (issue [6/6]); (a) no slower", "5"),
    Benchmark("first_epoch", "First epoch against later ones",
              "a Loader's first epoch over later ones' and its first element, and the "
              "drop-in's first batch against torch's; --eager for the rings before "
              "prefaulting", "none (a before/after; it prints, writes no results)", "1",
              in_make=False, reported=False),
    Benchmark("mix", "Mixing: Pipeline.mix against tf.data's sample_from_datasets",
              "elements/s of a 0.6/0.3/0.1 mix of Parquet and JSON lines inputs, in-process "
              "and in a Loader, one at a time and in batches; the mix's cost over its "
              "inputs read alone; the proportions realised",
              ">= 1x tf.data in-process at the same granularity; the mix <= 1.10x its "
              "inputs read alone; proportions within 1 point of the weights", "2"),
    Benchmark("mix_windows", "A mix's weights in every window, with workers",
              "windows of 1,000 failing chi-square (p < 0.001) against the weights with 1, "
              "2, 4, 8 workers: zloader's consumer drawing, and its workers drawing "
              "(inputs spread over them, and as written: before), against torch mixing "
              "per worker; an epoch's length with first_exhausted",
              "none stated (the table counts the windows failing)", "1"),
    Benchmark("exactness", "Exactly-once through stages that change the number of elements",
              "rows lost and repeated by 24 seeded pipelines with batch-map-unbatch stages, "
              "2 workers, resumed from a state and with a worker SIGKILLed, against "
              "pipeline.iter()",
              "none stated (it counts the exact cases)", "3"),
    Benchmark("deterministic_resume",
              "A deterministic Loader resumed with another number of workers",
              "whether runs are the same stream and a state at 10/50/90% resumes exactly "
              "the rest with 1, 2, 4 workers, one input and a mix; the first batch after a "
              "resume against a fresh Loader's",
              "none stated (it reports each resume exact or not)", "1"),
    Benchmark("sharing", "Sharing: one pipeline for K trainers, and a prefix for a sweep",
              "preprocessing CPU per epoch and each trainer's images/s for 1, 2, 4 trainers "
              "of one JPEG pipeline: zloader shared and unshared, torch, TensorSocket; and "
              "a sweep of 4 trainers sharing a decode with their own augmentation and "
              "batch size: worker CPU, decode calls, each trainer's epoch, exactness",
              "shared CPU at K = 4 <= 1.3x K = 1's; each shared trainer >= 0.9x a lone "
              "one; shared total >= TensorSocket's at equal workers; the sweep's worker "
              "CPU <= 1.4x one trainer's", "7"),
    Benchmark("shared_faults", "Shared jobs through moves, stops and deaths",
              "elements repeated and lost by each trainer of a shared job when a worker "
              "moves to another job, gets SIGTERM or SIGKILL mid-epoch, a trainer joining "
              "late", "none stated (it counts the exact runs)", "3"),
    Benchmark("coordinated", "Coordinated reads",
              "steps/s of 4 synchronous consumers over bucketed variable-length "
              "batches, coordinated against independent reads of one job",
              "coordinated / independent >= 1.8x", "1"),
    Benchmark("sources", "File-format sources against their own readers",
              "TFRecord, WebDataset and Parquet rates against tf.data, webdataset and "
              "pyarrow; JSON lines on a slow local S3, parallel_reads 8 against 1; a "
              "cached second epoch against the first",
              ">= each format's own reader at equal CPU; parallel_reads=8 >= 5x 1 when "
              "latency-bound; a cached second epoch >= 5x the first", "2", in_make=False),
    Benchmark("scale", "Scale-out: throughput against workers",
              "efficiency of 10 ms elements at 1-64 workers, embedded and over TCP, CPU "
              "per record against a paced bare receiver; four jobs on one pool; with "
              "--only fleet, the broker under 1,000 simulated workers and 200 consumers",
              "efficiency >= 0.85 at 32 workers and at 64 embedded, >= 0.8 at 64 over TCP; "
              "at 8 workers trainer / floor <= 3x, workers + trainer <= 250 µs a record; "
              "job shares within 20% of equal; fleet: broker < 30% of a core, EPOCH p99 "
              "< 50 ms", "5", in_make=False),
    Benchmark("hops", "What one hop of a record costs",
              "a process hop and a thread hop with nothing of zloader's in the way, and a "
              "paced bare receiver", "none (the floor under the record path)", "1",
              in_make=False),
    Benchmark("profile", "Per-thread profile of the record path",
              "CPU and context switches of every thread of a Loader's processes, by role",
              "none (where the CPU goes)", "1", in_make=False),
    Benchmark("autoscale_sim", "The autoscaling policy on simulated jobs",
              "over a simulated hour, when jobs needing 2 to 1,000 workers come within 5% "
              "of their need, their changes in the second half hour, and a need dropping "
              "from 32 to 8", "none stated (a before/after on another checkout)", "1"),
    Benchmark("soak", "Soak",
              "32 consumers over 8 jobs for 10 minutes while a worker is SIGKILLed about "
              "every 15 s: elements lost and duplicated per epoch, broker and worker RSS, "
              "leaks after close",
              "0 lost, 0 duplicated; broker and worker RSS flat (last third <= 1.2x the "
              "first + 16 MiB); no leaked fds, /dev/shm segments or processes", "11",
              in_make=False),
    Benchmark("gpu_train", "GPU end-to-end training (bench/gpu_train.py)",
              "images/s and data wait of ResNet-50 training fed by the drop-in against "
              "torch's DataLoader at equal workers, and of 4 ResNet-18 trainers sharing one "
              "run against a DataLoader each (needs a GPU; without one it runs --smoke)",
              "judged on a GPU only: zloader >= 1.0x torch, one trainer; shared search >= "
              "2.5x the DataLoaders' total", "1 (6 on a GPU)",
              results=("gpu_train", "gpu_train_smoke")),
)
"""Every benchmark, in the order ``make bench`` runs them and the report lists them."""


def readme() -> str:
    """bench/README.md: the list above as a table."""
    lines = [
        "# Benchmarks",
        "",
        "Generated from `bench/catalog.py` (`python -m bench.catalog --write`); edit the list "
        "there. Each benchmark runs side by side against its peers in one run and reports "
        "ratios (these machines are shared and noisy). Results: `bench/results/` (rendered "
        "into [bench/results/README.md](results/README.md) by `python -m bench.report`); "
        "logs of past runs are in `bench/archive/`. `make bench` runs those marked *make*, "
        "then the report. Minutes are on the 2-core development machine, with the defaults.",
        "",
        "| `python -m bench.…` | measures | targets | min | make |",
        "|---|---|---|---|---|",
    ]
    for bench in BENCHMARKS:
        lines.append(f"| `{bench.module}`: {bench.title} | {bench.measures} | "
                     f"{bench.targets} | {bench.minutes} | {'yes' if bench.in_make else '-'} |")
    lines += ["", "Also: `python -m bench.autoscale_trace` records the traces "
              "tests/test_autoscale.py replays (about 2 minutes).", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.catalog", description=__doc__)
    parser.add_argument("--write", action="store_true", help="write bench/README.md")
    args = parser.parse_args(argv)
    text = readme()
    if args.write:
        (pathlib.Path(__file__).parent / "README.md").write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
