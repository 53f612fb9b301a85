"""PNG plots of a sweep (sweep.json): latency and throughput against load, speculation AUTO against OFF.

matplotlib (Agg backend) is imported only when plotting, so running load needs no plotting stack.
Load levels sit at evenly spaced positions labelled with their value (a rate may be 'inf').
"""

from __future__ import annotations

from pathlib import Path

COLORS = {"auto": "tab:blue", "off": "tab:orange"}
LATENCIES = (("ttft", "TTFT"), ("itl", "ITL (per token)"), ("tpot", "TPOT"), ("e2el", "E2E latency"))
THROUGHPUTS = (("output_throughput", "output throughput (tok/s)"),
               ("request_throughput", "request throughput (req/s)"), ("goodput", "goodput (req/s)"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _levels(sweep: dict) -> list:
    levels: list = []
    for run in sweep["runs"]:
        if run["level"] not in levels:
            levels.append(run["level"])
    return levels


def _series(sweep: dict, mode: str, pick) -> tuple[list[int], list[float]]:
    levels = _levels(sweep)
    xs, ys = [], []
    for run in sweep["runs"]:
        value = pick(run["results"]) if run["speculation"] == mode else None
        if value is not None:
            xs.append(levels.index(run["level"]))
            ys.append(value)
    return xs, ys


def _axes_setup(ax, sweep: dict, ylabel: str) -> None:
    levels = _levels(sweep)
    ax.set_xticks(range(len(levels)), [str(level) for level in levels])
    ax.set_xlabel("request rate (req/s)" if sweep.get("load_kind") == "rate" else "concurrency")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def plot_latency(sweep: dict, path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, title) in zip(axes.flat, LATENCIES, strict=True):
        for mode in sweep["modes"]:
            for stat, style in (("p50", "-o"), ("p99", "--s")):
                xs, ys = _series(sweep, mode, lambda r, k=key, s=stat: _ms(r[k][s]))
                ax.plot(xs, ys, style, color=COLORS.get(mode), label=f"{mode.upper()} {stat}")
        ax.set_title(title)
        _axes_setup(ax, sweep, "ms")
        ax.legend(fontsize=8)
    return _save(plt, fig, path, "latency against load, speculation AUTO vs OFF")


def _save(plt, fig, path: Path, title: str | None = None) -> Path:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_throughput(sweep: dict, path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(THROUGHPUTS), figsize=(15, 4.5))
    for ax, (key, title) in zip(axes, THROUGHPUTS, strict=True):
        for mode in sweep["modes"]:
            xs, ys = _series(sweep, mode, lambda r, k=key: r[k])
            ax.plot(xs, ys, "-o", color=COLORS.get(mode), label=mode.upper())
        ax.set_title(title)
        _axes_setup(ax, sweep, title.split(" (")[-1].rstrip(")"))
        ax.legend(fontsize=8)
    return _save(plt, fig, path, "throughput against load, speculation AUTO vs OFF")


def plot_speculation(sweep: dict, path: Path) -> Path:
    """AUTO's acceptance and fallback share read from the server, and the AUTO/OFF output-throughput ratio."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for key, label in (("acceptance_rate", "acceptance"), ("fallback_share", "share of rounds in fallback")):
        xs, ys = _series(sweep, "auto", lambda r, k=key: r[k])
        left.plot(xs, ys, "-o", label=label)
    left.set_ylim(0, 1.05)
    left.set_title("speculation AUTO, from the server")
    _axes_setup(left, sweep, "fraction")
    left.legend(fontsize=8)
    levels = _levels(sweep)
    points = [(levels.index(r["level"]), r["auto_vs_off"]["output_throughput"]) for r in sweep.get("ratios", [])
              if r["auto_vs_off"]["output_throughput"] is not None]
    right.plot([x for x, _ in points], [y for _, y in points], "-o", color="tab:green")
    right.axhline(1.0, color="grey", linewidth=1)
    right.set_title("output throughput AUTO / OFF")
    _axes_setup(right, sweep, "ratio")
    return _save(plt, fig, path)


def plot_sweep(sweep: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [plot_latency(sweep, out / "latency.png"), plot_throughput(sweep, out / "throughput.png")]
    if "auto" in sweep["modes"]:
        paths.append(plot_speculation(sweep, out / "speculation.png"))
    return paths


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000.0
