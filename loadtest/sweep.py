"""A sweep: several load levels × speculation AUTO and OFF against one server, in one command.

Writes DIR/<level>-<mode>[-<repetition>]/{results.json,trace.jsonl} per run, DIR/sweep.json with every run's
results, the AUTO/OFF ratios and the analytic bound (tandem.bench.bound) per level, and the PNG plots of
loadtest.report.plots. Both modes of a level use the same seed, so they send the same prompts at the same arrival
times.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from loadtest import trace
from loadtest.config import RunConfig
from loadtest.prompts import Prompt
from loadtest.run import make_out_dir, results_of, run_to_dir, summary, write_json
from tandem.bench.bound import sweep_bound

# (name in sweep.json, results key, statistic): the quantities compared between AUTO and OFF per level.
RATIO_FIELDS = (
    ("output_throughput", "output_throughput", None),
    ("request_throughput", "request_throughput", None),
    ("goodput", "goodput", None),
    ("ttft_p50", "ttft", "p50"),
    ("ttft_p99", "ttft", "p99"),
    ("itl_p50", "itl", "p50"),
    ("itl_p99", "itl", "p99"),
    ("itl_chunk_p50", "itl_chunk", "p50"),
    ("itl_alone_p50", "itl_alone", "p50"),
    ("itl_shared_p50", "itl_shared", "p50"),
    ("itl_chunk_p99", "itl_chunk", "p99"),
    ("tpot_p50", "tpot", "p50"),
    ("tpot_p99", "tpot", "p99"),
    ("e2el_p50", "e2el", "p50"),
)


def level_name(config: RunConfig) -> str:
    """A directory-safe label: rate0.5, rateinf, concurrency4."""
    if config.concurrency is not None:
        return f"concurrency{config.concurrency}"
    return "rateinf" if math.isinf(config.rate) else f"rate{config.rate:g}"


def value_of(results: dict, key: str, stat: str | None) -> float | None:
    value = results.get(key)
    return value.get(stat) if stat is not None and isinstance(value, dict) else value


def ratios(auto: dict, off: dict) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name, key, stat in RATIO_FIELDS:
        a, o = value_of(auto, key, stat), value_of(off, key, stat)
        out[name] = a / o if a is not None and o else None
    return out


def level_configs(base: RunConfig, rates: list[float] | None, concurrencies: list[int] | None) -> list[RunConfig]:
    """One config per level; ValueError ("rates: ..." or "concurrencies: ...", as the flags are named) for a bad
    level or one given twice."""
    if bool(rates) == bool(concurrencies):
        raise ValueError("rates: give either --rates or --concurrencies")
    if rates:
        levels = [replace(base, rate=r, concurrency=None) for r in rates]  # parse_rate refused rates <= 0
    elif bad := [c for c in concurrencies if c < 1]:
        raise ValueError(f"concurrencies: must be at least 1, got {bad[0]}")
    else:
        levels = [replace(base, rate=None, concurrency=c) for c in concurrencies]
    # A level's directory and its entries in sweep.json are named by its label: a level given twice (or two rates
    # with one label, 2 and 2.0000001) would run twice into one directory, and sweep.json would keep one of them.
    labels = [level.load for level in levels]  # as level_name, to the digits {rate:g} keeps
    if twice := next((label for i, label in enumerate(labels) if label in labels[:i]), None):
        raise ValueError(f"{'rates' if rates else 'concurrencies'}: each level once, got {twice} twice")
    return levels


def plan_sweep(base: RunConfig, rates: list[float] | None, concurrencies: list[int] | None,
               repeats: int) -> list[RunConfig]:
    """The levels a sweep runs, checked before anything runs: ValueError naming the setting at fault."""
    if repeats < 1:
        raise ValueError(f"repeats: must be at least 1, got {repeats}")
    return level_configs(base, rates, concurrencies)


def _entry(config: RunConfig, mode: str, directory: str, results: dict) -> dict:
    return {"load": config.load, "level": config.concurrency if config.concurrency is not None
            else ("inf" if math.isinf(config.rate) else config.rate),
            "speculation": mode, "dir": directory, "results": results}


def pooled(directories: list[Path], slos: dict[str, float]) -> dict:
    """One results body over the requests of several repetitions laid end to end (latency percentiles over all
    their samples, throughput over their summed durations); the server's own figures from the last repetition."""
    merged = trace.concatenate([trace.load(directory / "trace.jsonl") for directory in directories])
    return results_of(merged, slos) | {"repetitions": len(directories)}


def run_sweep(base: RunConfig, out: Path, rates: list[float] | None = None, concurrencies: list[int] | None = None,
              modes: tuple[str, ...] = ("auto", "off"), prompts: list[Prompt] | None = None, plots: bool = True,
              echo=print, repeats: int = 1) -> dict:
    """With `repeats` > 1 each level runs its modes that many times, the order reversed every other time (AUTO OFF
    OFF AUTO ...) so a slow spell of the machine does not land on one mode; `runs` then pools each mode's
    repetitions, `repetitions` holds them one by one, and each level's ratios come with every repetition's own."""
    levels = plan_sweep(base, rates, concurrencies, repeats)
    make_out_dir(out)
    repetitions = []
    header = {"address": base.target, "load_kind": "concurrency" if concurrencies else "rate", "modes": list(modes),
              "repeats": repeats}
    for level in levels:
        for repetition in range(repeats):
            for mode in modes if repetition % 2 == 0 else modes[::-1]:
                config = replace(level, speculation=mode)
                directory = f"{level_name(config)}-{mode}" + (f"-{repetition + 1}" if repeats > 1 else "")
                try:
                    results = run_to_dir(config, out / directory, prompts)
                except KeyboardInterrupt:  # the finished runs make a sweep.json of their own; the cut one is left out
                    if repetitions:
                        assemble(out, header | {"interrupted_in": directory}, repetitions, plots=False)
                    raise
                echo(summary(results))
                repetitions.append(_entry(config, mode, directory, results) | {"repetition": repetition + 1})
    return assemble(out, header, repetitions, plots)


def rebuild(out: Path, plots: bool = True) -> dict:
    """Recompute every run's results.json and the sweep's sweep.json from the recorded traces (after a change to
    the metrics, or to look at an old sweep with today's definitions)."""
    sweep = json.loads((out / "sweep.json").read_text())
    repetitions = sweep.get("repetitions") or [run | {"repetition": 1} for run in sweep["runs"]]
    for entry in repetitions:
        run = trace.load(out / entry["dir"] / "trace.jsonl")
        entry["results"] = results_of(run, entry["results"].get("goodput_slos") or {})
        write_json(out / entry["dir"] / "results.json", entry["results"])
    header = {key: sweep[key] for key in ("address", "load_kind", "modes")} | {"repeats": sweep.get("repeats", 1)}
    return assemble(out, header, repetitions, plots)


def assemble(out: Path, header: dict, repetitions: list[dict], plots: bool) -> dict:
    """sweep.json from the runs one by one: one entry per level and mode (the repetitions pooled), the AUTO/OFF
    ratios per level (and per repetition), the analytic bound, the plots."""
    repeats, groups = header["repeats"], {}
    for entry in repetitions:  # in repetition order within each level and mode
        groups.setdefault((entry["load"], entry["speculation"]), []).append(entry)
    runs = []
    for mine in groups.values():
        run = {key: value for key, value in mine[0].items() if key != "repetition"}
        if repeats > 1:
            run |= {"dir": "", "results": pooled([out / r["dir"] for r in mine],
                                                 mine[0]["results"].get("goodput_slos") or {})}
        runs.append(run)
    comparisons = []
    for auto in (r for r in runs if r["speculation"] == "auto"):
        off = next((r for r in runs if r["speculation"] == "off" and r["load"] == auto["load"]), None)
        if off is not None:
            comparison = {"load": auto["load"], "level": auto["level"],
                          "auto_vs_off": ratios(auto["results"], off["results"])}
            if repeats > 1:
                comparison["auto_vs_off_each"] = [
                    ratios(a["results"], o["results"])
                    for a, o in zip(groups[auto["load"], "auto"], groups[auto["load"], "off"], strict=True)]
            comparisons.append(comparison)
    body = header | {"runs": runs, "ratios": comparisons}
    if repeats > 1:
        body["repetitions"] = repetitions
    body["bound"] = sweep_bound(body)
    write_json(out / "sweep.json", body)
    if plots:
        from loadtest.report.plots import plot_sweep

        body["plots"] = [p.name for p in plot_sweep(body, out)]
        write_json(out / "sweep.json", body)
    return body
