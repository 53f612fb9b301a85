"""A sweep: several load levels × speculation AUTO and OFF against one server, in one command.

Writes DIR/<level>-<mode>/{results.json,trace.jsonl} per run, DIR/sweep.json with every run's results, the AUTO/OFF
ratios and the analytic bound (loadtest.report.bound) per level, and the PNG plots of loadtest.report.plots. Both
modes of a level use the same seed, so they send the same prompts at the same arrival times.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from loadtest.config import RunConfig
from loadtest.prompts import Prompt
from loadtest.report.bound import sweep_bound
from loadtest.run import run_to_dir, summary, write_json

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
    if bool(rates) == bool(concurrencies):
        raise ValueError("rates: give either --rates or --concurrencies")
    if rates:
        return [replace(base, rate=r, concurrency=None) for r in rates]
    return [replace(base, rate=None, concurrency=c) for c in concurrencies]


def run_sweep(base: RunConfig, out: Path, rates: list[float] | None = None, concurrencies: list[int] | None = None,
              modes: tuple[str, ...] = ("auto", "off"), prompts: list[Prompt] | None = None, plots: bool = True,
              echo=print) -> dict:
    runs = []
    for level in level_configs(base, rates, concurrencies):
        for mode in modes:
            config = replace(level, speculation=mode)
            directory = f"{level_name(config)}-{mode}"
            results = run_to_dir(config, out / directory, prompts)
            echo(summary(results))
            runs.append({"load": config.load, "level": config.concurrency if config.concurrency is not None
                         else ("inf" if math.isinf(config.rate) else config.rate),
                         "speculation": mode, "dir": directory, "results": results})
    comparisons = []
    for auto in (r for r in runs if r["speculation"] == "auto"):
        off = next((r for r in runs if r["speculation"] == "off" and r["load"] == auto["load"]), None)
        if off is not None:
            comparisons.append({"load": auto["load"], "level": auto["level"],
                                "auto_vs_off": ratios(auto["results"], off["results"])})
    body = {"address": base.address, "load_kind": "concurrency" if concurrencies else "rate",
            "modes": list(modes), "runs": runs, "ratios": comparisons}
    body["bound"] = sweep_bound(body)
    write_json(out / "sweep.json", body)
    if plots:
        from loadtest.report.plots import plot_sweep

        body["plots"] = [p.name for p in plot_sweep(body, out)]
        write_json(out / "sweep.json", body)
    return body
