"""Benchmark report: every ``bench/results/*.json`` into one README.md with tables and plots.

    python -m bench.report [--results bench/results] [--out DIR]

Reads each JSON file a benchmark of bench/catalog.py wrote (``python -m bench.codec``,
``bench.transport``, ...) and writes
``README.md`` into ``--out`` (default: the results folder), one section per file: what the
file records about the machine and date, a markdown table, a PNG plot where one helps (written
next to the README, linked by a relative path) and a one-line reading of the headline ratio.
A last section plots throughput against the number of workers when some result has such a
series, and says so when none has.

Each known file has a title from bench/catalog.py and a renderer in ``RENDER`` (keyed by
file stem). A file without one, or
whose renderer fails on it (the benchmark changed its format), gets a table of its top-level
scalars instead; a file that cannot be parsed gets a line saying why. The report never fails
on a missing, unknown or garbled file. The README is generated: do not edit it by hand.
Plots use matplotlib's Agg canvas (no display needed), 800x450 px.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from bench.catalog import BENCHMARKS

Path = pathlib.Path
Renderer = Callable[[Any, Path], list[str]]

ZLOADER, PEER = "tab:blue", "tab:gray"
OTHERS = ("tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:olive")
LOG_RANGE = 30  # a value axis spanning more than this factor is drawn on a log scale
WORKER_KEYS = ("workers", "num_workers", "processes")
TRANSPORT_TITLES = {
    "a": "large batches, local", "b": "large batches over TCP", "c": "small elements (ints)",
    "d": "time to first element", "e": "TCP via a broker: CURVE keys vs none",
    "f": "small elements: exactly-once on vs off",
    "g": "batches of 256: exactly-once on vs off",
}
TORCH_LOADER_TITLES = {"1": "image pipeline (JPEG decode, crop, flip)",
                       "2": "transfer-bound (float32 3x224x224)", "3": "start-up and stop"}
SHARING_NAMES = {"zloader-shared": "zloader, share=True", "zloader-unshared": "zloader, unshared",
                 "torch": "torch DataLoader x K", "tensorsocket": "TensorSocket"}


# --- helpers --------------------------------------------------------------------------------

def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def num(value: Any) -> str:
    """A number for a table: thousands separated, a few significant digits."""
    if not is_number(value):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if value == 0 or abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    def cell(value: Any) -> str:
        return num(value).replace("|", "\\|").replace("\n", " ")

    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(cell(v) for v in row) + " |" for row in rows)]


def figure(columns: int = 1) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(1, columns, squeeze=False)[0])


def save(fig: Figure, out: Path, name: str, alt: str) -> str:
    fig.savefig(out / name)
    return f"![{alt}]({name})"


def log_if_wide(ax: Axes, values: Sequence[float], axis: str = "y") -> None:
    """A log scale, from the power of ten below the smallest value, when values span more
    than LOG_RANGE (bars on a log axis start at that limit, so it must be a round one)."""
    positive = [v for v in values if v > 0]
    if positive and max(positive) / min(positive) > LOG_RANGE:
        floor = 10 ** math.floor(math.log10(min(positive)))
        if axis == "y":
            ax.set_yscale("log")
            ax.set_ylim(bottom=floor)
        else:
            ax.set_xscale("log")
            ax.set_xlim(left=floor)


def recorded(data: Any) -> str:
    """The machine, versions and date a result records, as one line."""
    if not isinstance(data, dict):
        return "The file records no date or machine details."
    parts = [f"{key} {data[key]}" for key in ("date", "platform", "nproc", "cpu_count", "gpu",
                                              "device", "python", "numpy")
             if key in data and not isinstance(data[key], dict | list)]
    if isinstance(data.get("versions"), dict):
        parts.append("versions: " + ", ".join(f"{k} {v}" for k, v in data["versions"].items()))
    if not parts:
        return "The file records no date or machine details."
    return "Recorded: " + "; ".join(parts) + "."


def fallback(data: Any) -> list[str]:
    """Any JSON: a table of its top-level scalars."""
    if not isinstance(data, dict):
        kind = f"a list of {len(data)} items" if isinstance(data, list) else type(data).__name__
        return [f"Its top level is {kind}, not an object: nothing to tabulate."]
    scalars = [(key, f"{value:.6g}" if isinstance(value, float) else value)
               for key, value in data.items()
               if value is None or isinstance(value, str | int | float | bool)]
    nested = [key for key, value in data.items() if isinstance(value, dict | list)]
    lines = table(["field", "value"], scalars) if scalars else ["No top-level scalars."]
    if nested:
        lines += ["", "Nested fields not shown: " + ", ".join(f"`{k}`" for k in nested) + "."]
    return lines


# --- one renderer per benchmark -------------------------------------------------------------

def render_codec(data: Any, out: Path) -> list[str]:
    rows = data["rows"]
    codecs = list(rows[0]["seconds"])
    others = [c for c in codecs if c != "zloader"]
    body = [[row["element"], *(f"{row['seconds'][c] * 1e6:,.1f}" for c in codecs),
             *(f"{row['seconds'][c] / row['seconds']['zloader']:.2f}x" for c in others)]
            for row in rows]
    lines = [f"Round trip (encode, copy into one block, decode), median of {data['repeat']}; "
             "a ratio > 1 means zloader is faster.", "",
             *table(["element", *(f"{c} (µs)" for c in codecs),
                     *(f"{c} / zloader" for c in others)], body)]
    fig, (ax,) = figure()
    width = 0.8 / len(codecs)
    for i, name in enumerate(codecs):
        values = [row["seconds"][name] * 1e6 for row in rows]
        ax.bar([j + (i - (len(codecs) - 1) / 2) * width for j in range(len(rows))], values,
               width, label=name, color=ZLOADER if name == "zloader" else OTHERS[i])
    ax.set_xticks(range(len(rows)), [textwrap.fill(row["element"], 22) for row in rows])
    log_if_wide(ax, [s * 1e6 for row in rows for s in row["seconds"].values()])
    log = " (log scale)" if ax.get_yscale() == "log" else ""
    ax.set_ylabel(f"µs per round trip{log}, lower is better")
    ax.set_title("Codec round trip: zloader against pickle")
    ax.legend()
    lines += ["", save(fig, out, "codec.png", "codec round trip times")]
    first = rows[0]
    ratios = ", ".join(f"{c} / zloader {first['seconds'][c] / first['seconds']['zloader']:.2f}x"
                       for c in others)
    slower = [row["element"] for row in rows[1:]
              if any(row["seconds"][c] < row["seconds"]["zloader"] for c in others)]
    lines += ["", f"**Reading:** {first['element']}: {ratios}"
              + (f"; zloader is slower than a pickle on {', '.join(slower)}." if slower else ".")]
    return lines


def transport_metric(results: dict[str, Any]) -> str | None:
    """The throughput figure a transport section compares, None for a time section."""
    rows = [r for r in results.values() if r.get("error") is None]
    if not rows or any("median_s" in r for r in rows):
        return None
    return "gb_per_s" if rows[0].get("gb_per_s") else "elements_per_s"


def short(system: str) -> str:
    return system.split(" (")[0]


def render_transport(data: Any, out: Path) -> list[str]:
    lines = [f"Each figure is taken over a {data['window_s']:g} s window after a "
             f"{data['warmup_s']:g} s warm-up. Ratio: zloader / system for throughput, "
             "system / zloader for seconds (> 1: zloader is better); sections e-g compare "
             "zloader settings, their notes say which way."]
    peers: dict[str, list[tuple[str, str, float]]] = {}  # metric -> (section, system, value)
    reading = []
    for key, rows in data["tables"].items():
        lines += ["", f"### ({key}) {TRANSPORT_TITLES.get(key, f'section {key}')}", "",
                  *table(["system", "value", "ratio", "target", "holds", "note"],
                         [[r["system"], r["value"], r["ratio"], r["target"], r["holds"],
                           r["note"]] for r in rows])]
        results = data["results"].get(key, {})
        metric = transport_metric(results)
        if metric and any(not system.startswith("zloader") for system in results):
            for system, result in results.items():
                if result.get("error") is None:
                    peers.setdefault(metric, []).append((key, system, result[metric]))
            reading.append(f"({key}) " + ", ".join(
                f"{r['ratio']} {short(r['system'])}"
                + (f" [{r['target']}: {r['holds']}]" if r["holds"] in ("yes", "no") else "")
                for r in rows[1:]))
    if peers:
        fig, axes = figure(len(peers))
        units = {"gb_per_s": "GB/s of array bytes", "elements_per_s": "elements/s"}
        for ax, (metric, bars) in zip(axes, peers.items(), strict=True):
            labels = [f"{key}: {short(system)}" for key, system, _ in bars][::-1]
            values = [value for _, _, value in bars][::-1]
            colors = [ZLOADER if s.startswith("zloader") else PEER for _, s, _ in bars][::-1]
            ax.barh(labels, values, color=colors)
            log_if_wide(ax, values, "x")
            for y, value in enumerate(values):
                ax.annotate(f" {num(value)}", (value, y), va="center", fontsize=8)
            ax.set_xlim(right=max(values) * (4 if ax.get_xscale() == "log" else 1.25))
            ax.set_xlabel(units[metric] + (" (log scale)" if ax.get_xscale() == "log" else ""))
            sections = sorted({key for key, _, _ in bars})
            ax.set_title(", ".join(f"{k}: {TRANSPORT_TITLES.get(k, k)}" for k in sections),
                         fontsize=9)
        fig.suptitle("Transport: zloader (blue) against peer loaders, higher is better")
        lines += ["", save(fig, out, "transport.png", "transport throughput against peers")]
        lines += ["", "**Reading:** zloader / peer, throughput: " + "; ".join(reading) + "."]
    return lines


def render_torch_loader(data: Any, out: Path) -> list[str]:
    source = data.get("zloader_source", {})
    lines = [f"zloader.torch.DataLoader against torch.utils.data.DataLoader, "
             f"{data['num_workers']} workers each, batch {data['batch_size']}, "
             f"{data['samples']} samples an epoch, median of {data['runs']} alternating runs. "
             "Ratio: zloader / torch (higher is better for throughput, lower for CPU and "
             f"seconds). Same batches as torch: {data.get('same_batches_as_torch')}; zloader at "
             f"commit {str(source.get('commit', '?'))[:12]} with "
             f"{len(source.get('uncommitted', []))} uncommitted files under zloader/."]
    panels, reading, missed = [], [], []
    for key, rows in data["tables"].items():
        title = TORCH_LOADER_TITLES.get(key, f"table {key}")
        lines += ["", f"### ({key}) {title}", "", *table(
            ["system", "figure", "ratio", "target", "holds", "note"],
            [[r["system"], r["shown"], "-" if r["ratio"] is None else f"{r['ratio']:.2f}x",
              r["target"], r["holds"], r["note"]] for r in rows])]
        ours = [r for r in rows if r["ratio"] is not None]
        if ours:
            reading.append(f"{ours[0]['figure']} ({title.split(' (')[0]}) "
                           f"{ours[0]['ratio']:.2f}x")
        missed += [f"{r['figure']} ({title.split(' (')[0]}) {r['ratio']:.2f}x against "
                   f"{r['target']}" for r in ours if r["holds"] == "no"]
        rates = [r for r in rows if "/s" in r["shown"]]
        if rates:
            panels.append((title, rates))
    if panels:
        fig, axes = figure(len(panels))
        for ax, (title, rows) in zip(axes, panels, strict=True):
            figures = list(dict.fromkeys(r["figure"] for r in rows))
            systems = list(dict.fromkeys(r["system"] for r in rows))
            width = 0.8 / len(systems)
            for i, system in enumerate(systems):
                mine = {r["figure"]: r for r in rows if r["system"] == system}
                xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(figures))]
                values = [mine[f]["value"] if f in mine else 0 for f in figures]
                color = ZLOADER if system.startswith("zloader") else PEER
                ax.bar(xs, values, width, label=system, color=color)
                for x, f in zip(xs, figures, strict=True):
                    if f in mine and mine[f]["ratio"] is not None:
                        ax.annotate(f"{mine[f]['ratio']:.2f}x", (x, mine[f]["value"]),
                                    ha="center", va="bottom", fontsize=8)
            unit = rows[0]["shown"].split(": ", 1)[-1].split()[1]
            ax.set_xticks(range(len(figures)),
                          [f.removeprefix("images/s, ") for f in figures])
            ax.set_ylabel(f"{unit} (higher is better)")
            ax.set_title(title, fontsize=10)
            ax.margins(y=0.2)
        axes[0].legend(fontsize=8, loc="upper left")
        fig.suptitle("zloader.torch.DataLoader against torch DataLoader (label: zloader / torch)")
        lines += ["", save(fig, out, "torch_loader.png", "DataLoader throughput, zloader vs torch")]
    lines += ["", "**Reading:** zloader / torch: " + "; ".join(reading)
              + (f". Targets missed: {'; '.join(missed)}." if missed else "; every target holds.")]
    return lines


def render_sharing(data: Any, out: Path) -> list[str]:
    if not isinstance(data, dict):  # (a run from before the sweep)
        return _identical_sharing(data, out)
    lines = _identical_sharing(data["identical"], out) if data.get("identical") else []
    sweep = data.get("sweep") or []
    if not sweep:
        return lines
    one = next((r for r in sweep if r["system"] == "one"), None)
    names = {"one": "one trainer alone (zloader)", "zloader-shared": "zloader, share=True",
             "zloader-unshared": "zloader, 4 unshared Loaders", "torch": "torch DataLoader x 4"}
    body = [[names.get(r["system"], r["system"]), f"{r['worker_cpu_per_epoch']:.2f}",
             f"{r['worker_cpu_per_epoch'] / one['worker_cpu_per_epoch']:.2f}x" if one else "-",
             f"{r['decodes_per_epoch']:.0f}",
             " / ".join(f"{statistics.mean(s):.1f}" for s in r["seconds"]),
             "yes" if r["exact"] else "NO"] for r in sweep]
    return [*lines, "", "The sweep: four trainers share a JPEG decode and part after it "
            "(batch 32 / 64 / 128 / 256, two augmentation strengths); the "
            "prefix-shared job against four unshared Loaders and four torch "
            "DataLoaders (target: shared worker CPU <= 1.4x one trainer's).", "",
            *table(["system", "worker CPU-s / epoch", "vs one trainer", "decodes / epoch",
                    "each trainer's epoch, s", "every image once"], body)]


def _identical_sharing(data: Any, out: Path) -> list[str]:
    lone = {r["system"]: statistics.median(r["rates"]) for r in data if r["trainers"] == 1}
    cpu1 = {r["system"]: r["worker_cpu_per_epoch"] for r in data if r["trainers"] == 1}
    body = [[SHARING_NAMES.get(r["system"], r["system"]), r["trainers"],
             f"{r['worker_cpu_per_epoch']:.2f}",
             f"{r['worker_cpu_per_epoch'] / cpu1[r['system']]:.2f}x"
             if r["system"] in cpu1 else "-",
             f"{min(r['rates']):.0f}-{max(r['rates']):.0f}",
             f"{min(r['rates']) / lone[r['system']]:.2f}x" if r["system"] in lone else "-",
             f"{r['aggregate']:.0f}"] for r in data]
    lines = ["K trainer processes read one CPU-heavy JPEG pipeline. Worker CPU: the "
             "preprocessing side's CPU-seconds per epoch; rates: images/s from each trainer's "
             "first batch to its last.", "",
             *table(["system", "K", "worker CPU-s / epoch", "vs K=1",
                     "each trainer, images/s (min-max)", "vs lone trainer",
                     "sum over trainers, images/s"], body)]
    systems = list(dict.fromkeys(r["system"] for r in data))
    ks = sorted({r["trainers"] for r in data})
    by = {(r["system"], r["trainers"]): r for r in data}
    absent = [f"{SHARING_NAMES.get(s, s)} at K={k}" for s in systems for k in ks
              if (s, k) not in by]
    if absent:
        lines += ["", f"No rows for {', '.join(absent)}: the JSON does not record why (see "
                  "the benchmark's log or sharing.md)."]
    fig, (cpu_ax, rate_ax) = figure(2)
    others = iter(OTHERS)
    for system in systems:
        points = [(k, by[system, k]) for k in ks if (system, k) in by]
        style = {"marker": "o", "label": SHARING_NAMES.get(system, system),
                 "color": ZLOADER if system == "zloader-shared" else next(others, PEER)}
        cpu_ax.plot([k for k, _ in points], [r["worker_cpu_per_epoch"] for _, r in points],
                    **style)
        rate_ax.plot([k for k, _ in points], [r["aggregate"] for _, r in points], **style)
    log_if_wide(cpu_ax, [r["worker_cpu_per_epoch"] for r in data])
    log_if_wide(rate_ax, [r["aggregate"] for r in data])
    for ax, what in ((cpu_ax, "preprocessing CPU-s per epoch (lower is better)"),
                     (rate_ax, "images/s, sum over trainers (higher is better)")):
        ax.set_xticks(ks)
        ax.set_xlabel("trainers (K)")
        ax.set_ylabel(what + (" (log)" if ax.get_yscale() == "log" else ""), fontsize=9)
    cpu_ax.set_title("CPU per epoch vs trainers", fontsize=10)
    rate_ax.set_title("Aggregate throughput vs trainers", fontsize=10)
    cpu_ax.legend(fontsize=8)
    fig.suptitle("Sharing one pipeline among K trainers")
    lines += ["", save(fig, out, "sharing.png", "sharing: CPU and throughput vs trainers")]
    top = ks[-1]
    growth = [f"{SHARING_NAMES.get(s, s)} {by[s, top]['worker_cpu_per_epoch'] / cpu1[s]:.2f}x"
              for s in systems if (s, top) in by and s in cpu1]
    lines += ["", f"**Reading:** preprocessing CPU per epoch at K={top} / K=1: "
              + ", ".join(growth) + f" (images/s summed at K={top}: " + ", ".join(
                  f"{SHARING_NAMES.get(s, s)} {by[s, top]['aggregate']:.0f}"
                  for s in systems if (s, top) in by) + ")."]
    return lines


def render_coordinated(data: Any, out: Path) -> list[str]:
    medians = data["medians"]
    body = [[mode, f"{m['steps_per_s']:.1f}", f"{m['longest_tokens']:.0f}",
             f"{m['mean_tokens']:.0f}", f"{100 * m['one_bucket']:.0f}%"]
            for mode, m in medians.items()]
    runs = "; ".join(f"{mode} " + ", ".join(f"{r['steps_per_s']:.1f}" for r in rows)
                     for mode, rows in data["runs"].items())
    return ["Simulated synchronous data-parallel training over variable-length sequences: "
            "each step lasts as long as its longest batch. Median of the runs.", "",
            *table(["mode", "steps/s", "longest batch of a step (tokens)",
                    "mean batch (tokens)", "steps with one bucket"], body),
            "", f"Every run, steps/s: {runs}.", "",
            f"**Reading:** coordinated / independent steps/s: {data['ratio']:.2f}x; a "
            f"simulation of step times alone predicts {data['simulated']:.2f}x."]


def render_big_dataset(data: Any, out: Path) -> list[str]:
    medians = data["median_seconds"]
    torch_s = medians["torch"]
    body = [[name, f"{seconds:.2f}", f"{seconds / torch_s:.1f}x"]
            for name, seconds in medians.items()]
    return [f"A map-style dataset of {data['size']:,} (path, class) samples (what an "
            "ImageNet `ImageFolder` holds): seconds from constructing the loader to its "
            f"first batch of 256, median of {data['repeat']}.", "",
            *table(["loader", "construction to first batch (s)", "vs torch"], body), "",
            f"**Reading:** embedded zloader Loader {medians['Loader embedded']:.2f} s "
            "(target <= 3 s); the forked workers inherit the dataset, nothing is pickled."]


def render_soak(data: Any, out: Path) -> list[str]:
    rows = [["duration (min)", data["minutes"]], ["jobs", data["jobs"]],
            ["consumers (all jobs)", data["consumers"]], ["workers", data["workers"]],
            ["worker SIGKILLs", data["kills"]], ["epochs checked (job x epoch)", data["epochs"]],
            ["elements delivered", data["delivered"]], ["lost", data["lost"]],
            ["duplicated", data["duplicated"]], ["errors", len(data["errors"])],
            ["broker RSS, peak of first / last third (MiB)",
             f"{data['broker_mib_first_third']} / {data['broker_mib_last_third']}"],
            ["largest worker RSS, peak of first / last third (MiB)",
             f"{data['worker_mib_first_third']} / {data['worker_mib_last_third']}"],
            ["leaked fds", data["leaked_fds"]], ["leaked /dev/shm segments",
                                                 data["leaked_segments"]],
            ["stray processes", data["stray_processes"]]]
    lines = ["Many consumers over many jobs, exactly-once, while workers are killed and "
             "replaced.", "", *table(["measure", "value"], rows)]
    samples = data.get("samples") or []
    if samples:
        fig, (ax,) = figure()
        minutes = [s["t"] / 60 for s in samples]
        ax.plot(minutes, [s["worker_mib"] for s in samples], label="largest worker")
        ax.plot(minutes, [s["broker_mib"] for s in samples], label="broker")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("minutes into the run")
        ax.set_ylabel("resident memory (MiB)")
        ax.set_title(f"Soak: memory over {data['minutes']} min, {data['kills']} worker kills")
        ax.legend()
        lines += ["", save(fig, out, "soak.png", "soak: memory over time")]
    lines += ["", f"**Reading:** {data['delivered']:,} elements over {data['epochs']} epochs "
              f"with {data['kills']} worker kills: {data['lost']} lost, {data['duplicated']} "
              f"duplicated; broker RSS {data['broker_mib_first_third']} -> "
              f"{data['broker_mib_last_third']} MiB (first third -> last third)."]
    return lines


def render_gpu_train(data: Any, out: Path) -> list[str]:
    """bench/gpu_train.py: images/s and the GPU's data wait per scenario, and the ratios
    against the issue's targets (judged only on a GPU)."""
    scenarios = data["scenarios"]
    rows = [[name, s.get("label", ""), s.get("workers", "-"), num(s.get("images_per_s", 0)),
             f"{100 * s.get('wait_fraction', 0):.1f}%", s.get("status", "")]
            for name, s in scenarios.items()]
    device = data.get("device", {})
    lines = [f"bf16 training steps fed by the image pipeline, on {device.get('type', '?')} "
             f"({device.get('name', '?')}); data wait: the share of step time the trainer "
             "(and so the device) waited for the next batch.", "",
             *table(["scenario", "loader", "workers", "images/s (total)", "data wait",
                     "status"], rows)]
    ratio_rows = [[r["label"], f"{r['value']:.2f}x" if r.get("value") is not None else "-",
                   f">= {r['target']:.2f}x" if r.get("target") else "-",
                   {True: "yes", False: "NO", None: "not judged"}[r.get("holds")]]
                  for r in data.get("ratios", {}).values()]
    lines += ["", *table(["figure", "value", "target", "holds"], ratio_rows)]
    ok = [(name, s["images_per_s"]) for name, s in scenarios.items()
          if s.get("status") == "ok" and is_number(s.get("images_per_s"))]
    if ok:
        fig, (ax,) = figure()
        ax.barh([n for n, _ in ok][::-1], [v for _, v in ok][::-1],
                color=["tab:blue" if "zloader" in n else "tab:gray" for n, _ in ok][::-1])
        ax.set_xlabel("images/s (all trainers)")
        ax.set_title(f"Training fed by each loader ({device.get('type', '?')})")
        lines += ["", save(fig, out, f"{data.get('_stem', 'gpu_train')}.png",
                           "training throughput per scenario")]
    judged = "judged on a GPU" if data.get("judged") else "not judged: no GPU, a smoke test"
    lines += ["", f"**Reading:** {judged}; " + "; ".join(
        f"{r['label']} {r['value']:.2f}x" for r in data.get("ratios", {}).values()
        if r.get("target") and r.get("value") is not None) + "."]
    return lines


def render_sources(data: Any, out: Path) -> list[str]:
    """bench/sources.py: each format's readers side by side, and the S3 latency runs."""
    units = {"tfrecord": "records", "webdataset": "samples", "parquet": "rows",
             "cache": "images"}
    lines: list[str] = []
    for name, rates in data["results"].items():
        best = max(rates.values())
        unit = units.get(name, "rows")
        lines += [f"**{name}**", "", *table(["reader", f"{unit}/s", "vs best"], [
            [reader, f"{value:,.0f}", f"{value / best:.2f}"] for reader, value in rates.items()
        ]), ""]
    reading = []
    if "s3_speedup_8_vs_1" in data:
        reading.append(f"parallel_reads=8 against 1 on the S3 server: "
                       f"{data['s3_speedup_8_vs_1']:.1f}x at the benchmark's latency "
                       "(see sources.md for the longer latency and why)")
    if "cache_speedup_epoch2_vs_epoch1" in data:
        reading.append(f"a cached second epoch against the first (decode and resize "
                       f"JPEGs): {data['cache_speedup_epoch2_vs_epoch1']:.1f}x (target >= 5x)")
    if reading:
        lines += ["**Reading:** " + "; ".join(reading) + "."]
    return lines


def render_scale(data: Any, out: Path) -> list[str]:
    """bench/scale.py: throughput against workers (a plot and its table), several jobs on
    one pool, and the broker's control plane alone."""
    points = [p for p in data.get("scale", []) if "error" not in p]
    lines = [f"Elements of {data.get('element_ms', 10):g} ms of waiting (wall time, not this "
             "host's CPU); efficiency = measured / ideal.", ""]
    if points:
        fig, (ax,) = figure()
        workers = sorted({p["workers"] for p in points})
        ax.plot(workers, [w * 1000 / data.get("element_ms", 10) for w in workers], "k:",
                label="ideal")
        for mode in sorted({p["mode"] for p in points}):
            mine = sorted((p["workers"], p["elements_per_s"]) for p in points
                          if p["mode"] == mode)
            ax.plot([w for w, _ in mine], [v for _, v in mine], "o-", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("workers (log scale)")
        ax.set_ylabel("elements/s (log scale)")
        ax.legend()
        lines += [save(fig, out, f"{data.get('_stem', 'scale')}.png",
                       "throughput against workers"), "",
                  *table(["mode", "workers", "elements/s", "efficiency", "CPU per element",
                          "the trainer's", "workers + trainer", "floor", "trainer / floor"],
                         [[p["mode"], p["workers"], f"{p['elements_per_s']:.0f}",
                           f"{p['efficiency']:.2f}", f"{p['cpu_us_per_element']:.0f} µs",
                           _us(p.get("consumer_us_per_element")),
                           _us(p.get("workers_trainer_us_per_element")),
                           _us(p.get("floor_us_per_message")),
                           f"{p['trainer_over_floor']:.1f}x"
                           if is_number(p.get("trainer_over_floor")) else "-"]
                          for p in points]), ""]
        if any("floor_us_per_message" in p for p in points):
            lines += ["The floor: a bare Python process woken once per ZeroMQ message (PUSH/PULL "
                      "over ipc), paced at the elements/s of its row, measured in the same run; "
                      "its CPU per message. Targets at 8 workers: trainer / floor <= 3x, "
                      "workers + trainer <= 250 µs.", ""]
    jobs = data.get("several_jobs")
    if isinstance(jobs, dict) and jobs.get("shares"):
        lines += [f"**Four jobs on {jobs['pool']} workers:** shares "
                  + ", ".join(f"{share:.2f}" for share in jobs["shares"])
                  + f"; the late job waited {jobs['late_first_element_s']:.2f} s for its "
                  "first element.", ""]
    fleet = data.get("fleet")
    if isinstance(fleet, dict) and "broker_cpu" in fleet:
        lines += [f"**The control plane alone:** {fleet['workers']} workers and "
                  f"{fleet['consumers']} consumers: broker CPU {fleet['broker_cpu']:.2f} of a "
                  f"core, EPOCH answer p99 {1000 * fleet['epoch_p99_s']:.1f} ms."]
    return lines


def _us(value: Any) -> str:
    return f"{value:.0f} µs" if is_number(value) else "-"


def render_profile(data: Any, out: Path) -> list[str]:
    """bench/profile.py: CPU and context switches per element, by thread role."""
    from bench.profile import markdown as profile_markdown

    return profile_markdown(data)


def render_hops(data: Any, out: Path) -> list[str]:
    """bench/hops.py: what one hop of a record costs on the machine."""
    from bench.hops import table as hops_table

    return ["The floor under the record path: a record makes about three hops (producer "
            "to socket thread, worker to consumer, I/O thread to iterating thread) and a "
            "share of a CREDIT's.", "", *hops_table(data)]


def memory_tables(data: Any) -> list[str]:
    """bench.memory's tables (written by it into memory.md, and here)."""
    mib = 2**20
    lines = []
    if "copy_on_read" in data:
        lines += ["### (1) Copy on read: the workers' USS growth over one epoch", "",
                  "| dataset | one copy | loader | workers' USS after start-up (sum) | "
                  "growth (sum of workers) | of it, in /dev/shm | copies | "
                  "target | construction to first batch | first batch to last | whole epoch |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for label, result in data["copy_on_read"].items():
            for name, run in result["runs"].items():
                target = "<= 0.1" if name == "zloader" else "-"
                shm = (f"{run['shm_growth'] / mib:.0f} MiB" if "shm_growth" in run else "-")
                lines.append(
                    f"| {result['samples']:,} {label} | {result['one_copy'] / mib:.0f} MiB | "
                    f"{name} | {sum(run['base_uss']) / mib:.0f} MiB | "
                    f"{run['growth'] / mib:.0f} MiB | {shm} | {run['growth_copies']:.2f} | "
                    f"{target} | {run['first_batch_s']:.2f} s | "
                    f"{run['epoch_s'] - run['first_batch_s']:.2f} s | {run['epoch_s']:.2f} s |")
        lines.append("")
    if "worker_base" in data:
        base = data["worker_base"]
        ratio = base["zloader"]["median"] / base["torch"]["median"]
        lines += ["### (2) A worker's base (USS once it sent two batches, median)", "",
                  "| torch | zloader | zloader / torch | target |", "|---|---|---|---|",
                  f"| {base['torch']['median'] / mib:.1f} MiB | "
                  f"{base['zloader']['median'] / mib:.1f} MiB | {ratio:.2f} | <= 2 |", ""]
    if "rings" in data:
        lines += ["### (3) Rings against workers (peaks over one epoch)", "",
                  "| workers | /dev/shm held | total PSS (Loader and workers) |",
                  "|---|---|---|"]
        lines += [f"| {p['workers']} | {p['shm_peak'] / mib:.0f} MiB | "
                  f"{p['pss_peak'] / mib:.0f} MiB |" for p in data["rings"]]
        lines.append("")
    if "over_epochs" in data:
        lines += ["### (4) Persistent workers over epochs", "",
                  "| loader | epochs | largest change of a worker's RSS against epoch 2 | "
                  "target |", "|---|---|---|---|"]
        for name, result in data["over_epochs"].items():
            lines.append(f"| {name} | {len(result['rss'])} | {result['largest_change']:.1%} "
                         f"| {'<= 5%' if name == 'zloader' else '-'} |")
        lines.append("")
    return lines


def render_memory(data: Any, out: Path) -> list[str]:
    lines = memory_tables(data)
    if (out / "memory.png").exists():
        lines += ["![memory against workers and epochs](memory.png)", ""]
    return lines


def mix_tables(data: Any) -> list[str]:
    """bench.mix's tables (written by it into mix.md, and here): elements/s per run against
    tf.data, the mix's cost over its inputs read alone, the realised proportions."""
    weights = data["weights"]
    names = list(data["inputs"])
    runs = data["runs"]
    lines = ["### Elements/s: zloader against tf.data's sample_from_datasets", "",
             *table(["run", "elements", "seconds", "elements/s",
                     "vs tf.data in-process (same granularity)", "target", "holds"],
                    [[r["name"], r["elements"], f"{r['seconds']:.2f}",
                      f"{r['elements_per_s']:,.0f}",
                      f"{r['vs_tf']:.2f}x" if "vs_tf" in r else "1.00x",
                      ">= 1x" if "vs_tf" in r else "-",
                      ("yes" if r["vs_tf"] >= 1 else "NO") if "vs_tf" in r else "-"]
                     for r in runs]), ""]
    notes = [f"{r['name']}: {r['note']}" for r in runs if r.get("note")]
    if notes:
        lines += ["Notes: " + "; ".join(notes) + ".", ""]
    cost = data["mix_cost"]
    median, cpu = cost["median_s"], cost.get("median_cpu_s")
    elements = data["elements"]
    shares = ", ".join(f"{w:g} N of {n}" for n, w in zip(names, weights, strict=True))
    reads = [("alone", "the inputs read alone, one after another (" + shares + ")"),
             ("mix", 'Pipeline.mix(..., stop="never").take(N)'),
             ("by_hand", "control: the inputs' iterators interleaved by numpy draws in "
                         "plain Python")]

    def holds(key: str, ratio: float) -> str:
        return ("yes" if ratio <= cost["target"] else "NO") if key == "mix" else "-"

    body = []
    for key, what in reads:
        wall = median[key] / median["alone"]
        row = [what, f"{median[key]:.2f}", f"{elements / median[key]:,.0f}", f"{wall:.2f}x"]
        if cpu:
            row += [f"{cpu[key]:.2f}", f"{cpu[key] / cpu['alone']:.2f}x"]
        row += [f"<= {cost['target']:.2f}x" if key == "mix" else "-", holds(key, wall)]
        if cpu:
            row.append(holds(key, cpu[key] / cpu["alone"]))
        body.append(row)
    header = ["read", "seconds", "elements/s", "vs the inputs alone"]
    if cpu:
        header += ["CPU seconds", "CPU vs the inputs alone", "target", "holds (wall)",
                   "holds (CPU)"]
    else:
        header += ["target", "holds"]
    every = "; ".join(f"{key} " + ", ".join(f"{s:.2f}" for s in values)
                      for key, values in cost["seconds"].items())
    if "cpu_seconds" in cost:
        every += "; CPU: " + "; ".join(f"{key} " + ", ".join(f"{s:.2f}" for s in values)
                                       for key, values in cost["cpu_seconds"].items())
    lines += [f"### The mix's cost over its inputs read alone (in-process, N = {elements:,}, "
              f"median of {cost['rounds']} rounds)", "", *table(header, body), "",
              f"Every round, seconds: {every}. The same draws every round: "
              f"{cost['same_draws_each_round']}.", ""]
    tolerance = data.get("tolerance", 0.01)
    body = []
    for r in runs:
        for point, result in r["proportions"].items():
            body.append([r["name"], f"{int(point):,}",
                         *(f"{result['shares'][n]:.4f}" for n in names),
                         f"{100 * result['largest_difference']:.2f} points",
                         "yes" if result["within"] else "NO"])
    lines += ["### Realised proportions", "",
              *table(["run", "after elements",
                      *(f"{n} ({w:g})" for n, w in zip(names, weights, strict=True)),
                      "largest distance from the weights",
                      f"within {100 * tolerance:g} point"], body), ""]
    same = [f"{r['name']} draws the same inputs as {other}: {r[key]}"
            for r in runs for key, other in (("same_draws_as_elements", "one at a time"),
                                             ("same_draws_as_batches", "in batches"))
            if key in r]
    left = data.get("left_behind", {})
    leftovers = sum(len(v) for v in left.values() if isinstance(v, list))
    lines += [("; ".join(same) + ". " if same else "")
              + ("Left behind after the run: nothing (no worker process, /dev/shm segment "
                 "or socket folder)." if not leftovers else
                 "Left behind after the run: " + json.dumps(left) + "."), ""]
    element = {r["system"]: r for r in runs if r["granularity"] == "element"
               and "Loader" not in r["name"]}
    batch = {r["system"]: r for r in runs if r["granularity"] == "batch"
             and "Loader" not in r["name"]}
    missed = [f"{r['name']} at {int(p):,}" for r in runs
              for p, result in r["proportions"].items() if not result["within"]]
    reading = []
    if "zloader" in element and "vs_tf" in element["zloader"]:
        reading.append(f"zloader / tf.data in-process: {element['zloader']['vs_tf']:.2f}x "
                       "one element at a time")
    if "zloader" in batch and "vs_tf" in batch["zloader"]:
        reading.append(f"{batch['zloader']['vs_tf']:.2f}x in batches")
    cpu_part = (f", {100 * (cost['cpu_ratio'] - 1):+.0f}% in CPU time"
                if "cpu_ratio" in cost else "")
    reading.append(f"the mix costs {100 * (cost['ratio'] - 1):+.0f}% over its inputs read "
                   f"alone{cpu_part} (target <= {100 * (cost['target'] - 1):.0f}%; the "
                   f"plain-Python interleaving {100 * (cost['by_hand_ratio'] - 1):+.0f}%)")
    reading.append("every realised proportion within " f"{100 * tolerance:g} point of its weight"
                   if not missed else "proportions off by more than "
                   f"{100 * tolerance:g} point: " + ", ".join(missed))
    return [*lines, "**Reading:** " + "; ".join(reading) + "."]


def render_mix(data: Any, out: Path) -> list[str]:
    return mix_tables(data)


def render_exactness(data: Any, out: Path) -> list[str]:
    """bench/exactness.py: rows lost and repeated per fault."""
    lines = ["| fault | cases | exact | rows lost | rows repeated | worst lost / repeated |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {row['mode']} | {row['cases']} | {row['exact']} | {row['rows_lost']} | "
              f"{row['rows_repeated']} | {row['worst_lost']} / {row['worst_repeated']} |"
              for row in data]
    return lines


def mix_windows_tables(data: Any) -> list[str]:
    """bench/mix_windows.py: a mix's weights in every window, by system and workers."""
    sizes = " / ".join(f"{n:,}" for n in data["sizes"])
    splits = " / ".join(map(str, data["splits"]))
    lines = [f"Weights {' / '.join(map(str, data['weights']))}, inputs of {sizes} elements "
             f"in {splits} splits, windows of {data['window']:,} over the first "
             f"{data['limit']:,} elements; a window fails at chi-square p < "
             f"{data['p_floor']}. nproc {data['nproc']}, zloader at "
             f"{str(data['provenance']['commit'])[:12]}.", "",
             "| system | workers | windows failing | smallest p | 10% input's share | "
             "iter()'s draws | every element once | first batch (s) | elements/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in data["runs"]:
        low, high = row["small_share"] or (0, 0)
        lines.append(f"| {row['system']} | {row['workers']} | {row['failing']} of "
                     f"{row['windows']} | {row['smallest_p']:.2g} | {low:.3f}-{high:.3f} | "
                     f"{'yes' if row['iter_draws'] else 'no'} | "
                     f"{'yes' if row['every_element_once'] else 'NO'} | "
                     f"{row['first_batch_s']:.3f} | {num(row['elements_per_s'])} |")
    lines += ["", "stop=\"first_exhausted\": elements of an epoch against iter()'s", "",
              "| system | workers | elements | iter() | ratio |", "|---|---|---|---|---|"]
    lines += [f"| {row['system']} | {row['workers']} | {row['elements']:,} | {row['iter']:,} "
              f"| {row['elements'] / row['iter']:.3f} |" for row in data["first_exhausted"]]
    return lines


def render_mix_windows(data: Any, out: Path) -> list[str]:
    return mix_windows_tables(data)


def render_deterministic_resume(data: Any, out: Path) -> list[str]:
    from bench.deterministic_resume import tables
    return tables(data)


def render_startup(data: Any, out: Path) -> list[str]:
    from bench.startup import tables
    return tables(data)[2:]  # (its own heading, which the report gives)


def render_native(data: Any, out: Path) -> list[str]:
    from bench.native import tables
    return tables(data)[2:]  # (its own heading, which the report gives)


def render_shared_faults(data: Any, out: Path) -> list[str]:
    from bench.shared_faults import table
    return table(data["results"]).splitlines()


def render_autoscale_sim(data: Any, out: Path) -> list[str]:
    lines = ["| need | within 5% after | count after 1 h | most asked | changes in the second "
             "half hour |", "|---|---|---|---|---|"]
    for row in data["rows"]:
        reached = f"{row['reached_s']} s" if row["reached_s"] is not None else "never"
        lines.append(f"| {row['need']} | {reached} | {row['final']} | {row['most']} | "
                     f"{row['changes_second_half']} |")
    return lines


RENDER: dict[str, Renderer] = {
    "codec": render_codec, "transport": render_transport, "torch_loader": render_torch_loader,
    "big_dataset": render_big_dataset, "memory": render_memory, "sharing": render_sharing,
    "coordinated": render_coordinated, "soak": render_soak, "sources": render_sources,
    "scale": render_scale, "hops": render_hops, "profile": render_profile,
    "gpu_train": render_gpu_train, "gpu_train_smoke": render_gpu_train, "mix": render_mix,
    "exactness": render_exactness, "mix_windows": render_mix_windows,
    "deterministic_resume": render_deterministic_resume, "startup": render_startup,
    "shared_faults": render_shared_faults, "autoscale_sim": render_autoscale_sim,
    "native": render_native,
}
"""Each result file's renderer, by stem."""

RENDERERS: dict[str, tuple[str, Renderer | None]] = {
    stem: (bench.title + (" (CPU smoke run, --smoke)" if stem.endswith("_smoke") else ""),
           RENDER.get(stem))
    for bench in BENCHMARKS for stem in bench.stems}
"""Title and renderer by file stem, in bench/catalog.py's order (the report's)."""


# --- scaling with workers -------------------------------------------------------------------

def worker_counts(data: Any) -> tuple[set[int], dict[str, dict[int, list[float]]]]:
    """Every worker count a result records, and its throughput series by worker count: a
    dict holding a worker count and a ``*_per_s`` (or ``aggregate``) number is a point."""
    counts: set[int] = set()
    series: dict[str, dict[int, list[float]]] = {}

    def walk(node: Any, where: str) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item, where)
        if not isinstance(node, dict):
            return
        workers = [node[k] for k in WORKER_KEYS if isinstance(node.get(k), int)
                   and not isinstance(node[k], bool)]
        counts.update(workers)
        rate = next(((k, v) for k, v in node.items() if is_number(v)
                     and (k.endswith("_per_s") or k == "aggregate")), None)
        if workers and rate:
            label = f"{node.get('system') or node.get('mode') or node.get('name') or where}"
            series.setdefault(f"{label} ({rate[0]})", {}).setdefault(
                workers[0], []).append(rate[1])
        for key, value in node.items():
            walk(value, key)

    walk(data, "")
    return counts, {label: points for label, points in series.items() if len(points) > 1}


def scaling(loaded: dict[str, Any], out: Path) -> list[str]:
    lines = ["## Scaling with workers", ""]
    recorded_counts, found = [], {}
    for stem, data in loaded.items():
        counts, series = worker_counts(data)
        if counts:
            recorded_counts.append(f"{stem}: {', '.join(map(str, sorted(counts)))}")
        found.update({f"{stem}: {label}": points for label, points in series.items()})
    if not found:
        return [
            *lines,
            "No result has throughput at several worker counts, so there is no scaling plot. "
            "Worker counts the files record: " + ("; ".join(recorded_counts) or "none") + ". "
            "(sharing varies the number of trainers with the workers fixed: see its section.)"]
    fig, (ax,) = figure()
    for label, points in found.items():
        xs = sorted(points)
        ax.plot(xs, [statistics.median(points[x]) for x in xs], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers")
    ax.set_ylabel("throughput (per second, as the label's field)")
    ax.set_title("Throughput against the number of workers")
    ax.legend(fontsize=8)
    return [*lines, "Series found: " + "; ".join(found) + " (median where repeated).", "",
            save(fig, out, "scaling.png", "throughput vs workers")]


# --- the README -----------------------------------------------------------------------------

def load(path: Path) -> tuple[Any, str | None]:
    try:
        return json.loads(path.read_text()), None
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError included
        return None, f"{type(exc).__name__}: {exc}"


def known_stem(stem: str) -> str | None:
    """The RENDERERS key for a file stem: itself, or the longest key it extends with
    ``_<suffix>`` (``scale_baseline`` is a scale result, ``profile_after`` a profile)."""
    if stem in RENDERERS:
        return stem
    keys = [key for key in RENDERERS if stem.startswith(key + "_")]
    return max(keys, key=len) if keys else None


def section(stem: str, data: Any, out: Path) -> list[str]:
    key = known_stem(stem)
    title, renderer = RENDERERS[key] if key else (stem, None)
    if key and key != stem:
        title += f" ({stem[len(key) + 1:]})"
    lines = [f"## {title} (`{stem}.json`)", "", recorded(data), ""]
    if renderer is None:
        return [*lines, "No renderer for this file; its top-level scalars:", "", *fallback(data)]
    try:
        if (stem.startswith("gpu_train") or key != stem) and isinstance(data, dict):
            data = {**data, "_stem": stem}
        return lines + renderer(data, out)
    except Exception as exc:  # a changed format must not stop the report
        why = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:200]
        return [*lines, f"The {stem} renderer failed on this file ({why}); its top-level "
                "scalars instead:", "", *fallback(data)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="bench/results", help="folder of *.json results")
    parser.add_argument("--out", help="where README.md and the PNGs go (default: --results)")
    args = parser.parse_args(argv)
    results = Path(args.results)
    out = Path(args.out or args.results)
    out.mkdir(parents=True, exist_ok=True)
    known = list(RENDERERS)

    def rank(path: Path) -> tuple[int, str]:
        key = known_stem(path.stem)
        return (known.index(key) if key else len(known), path.stem)

    paths = sorted(results.glob("*.json"), key=rank)
    lines = ["# Benchmark results", "",
             "Generated by `python -m bench.report` from the JSON files in this folder; do not "
             "edit by hand. The machines are shared and noisy: read the ratios, not the "
             "absolute numbers. Each benchmark's own table is in its `.md` file.", ""]
    loaded: dict[str, Any] = {}
    for path in paths:
        data, error = load(path)
        if error is not None:
            key = known_stem(path.stem)
            lines += [f"## {RENDERERS[key][0] if key else path.stem} (`{path.name}`)", "",
                      f"Could not read this file: {error[:200]}", ""]
            continue
        loaded[path.stem] = data
        lines += [*section(path.stem, data, out), ""]
    found = {known_stem(path.stem) for path in paths}
    missing = [stem for stem in known if stem not in found]
    if missing:
        lines += ["## Not run", "", "No results yet for: " + ", ".join(
            f"`{stem}` (`python -m bench.{stem}`)" for stem in missing) + ".", ""]
    lines += scaling(loaded, out)
    (out / "README.md").write_text("\n".join(lines).rstrip() + "\n")
    print(f"wrote {out / 'README.md'} ({len(paths)} result files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
