"""Markdown tables of a finished sweep (sweep.json): each run's metrics, AUTO against OFF per level with the
issue's targets checked, and the analytic bound. `python -m loadtest report DIR/sweep.json` prints them.

Targets (docs/performance.md): at every load AUTO's p50 and p99 ITL <= 1.02x OFF's; at the lowest load AUTO's p50
ITL at least 1.3x better (<= 1/1.3 of OFF's); at the highest load AUTO's output throughput >= OFF's.
"""

from __future__ import annotations

from loadtest.sweep import value_of
from tandem.bench.bound import sweep_bound

ITL_LIMIT = 1.02
LOW_LOAD_GAIN = 1.3

RUN_COLUMNS = (
    ("output tok/s", "output_throughput", None, 1.0, "{:.2f}"),
    ("TTFT p50 s", "ttft", "p50", 1.0, "{:.2f}"),
    ("ITL p50 ms", "itl", "p50", 1000.0, "{:.0f}"),
    ("ITL p99 ms", "itl", "p99", 1000.0, "{:.0f}"),
    ("chunk ITL p50 ms", "itl_chunk", "p50", 1000.0, "{:.0f}"),
    ("tokens alone", "alone_token_share", None, 1.0, "{:.2f}"),
    ("ITL p50 alone ms", "itl_alone", "p50", 1000.0, "{:.0f}"),
    ("ITL p50 shared ms", "itl_shared", "p50", 1000.0, "{:.0f}"),
    ("TPOT p50 ms", "tpot", "p50", 1000.0, "{:.0f}"),
    ("E2E p50 s", "e2el", "p50", 1.0, "{:.1f}"),
    ("acceptance", "acceptance_rate", None, 1.0, "{:.2f}"),
    ("fallback rounds", "fallback_share", None, 1.0, "{:.2f}"),
)
RATIO_COLUMNS = ("output_throughput", "ttft_p50", "itl_p50", "itl_p99", "itl_chunk_p50", "itl_alone_p50",
                 "itl_shared_p50", "tpot_p50", "e2el_p50")
SPREAD_COLUMNS = ("output_throughput", "itl_p50", "itl_p99")


def _fmt(value: float | None, pattern: str = "{:.2f}", scale: float = 1.0) -> str:
    return "-" if value is None else pattern.format(value * scale)


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def runs_table(sweep: dict) -> str:
    rows = []
    for run in sweep["runs"]:
        results = run["results"]
        rows.append([str(run["level"]), run["speculation"].upper(), f"{results['completed']}/{results['requests']}",
                     *(_fmt(value_of(results, key, stat), pattern, scale)
                       for _, key, stat, scale, pattern in RUN_COLUMNS)])
    return _table(["load", "mode", "done", *(name for name, *_ in RUN_COLUMNS)], rows)


def target_checks(sweep: dict) -> list[dict]:
    """Per level: the AUTO/OFF ratios and which targets hold (None where not applicable)."""
    levels = sweep["ratios"]
    checks = []
    for index, level in enumerate(levels):
        ratio = level["auto_vs_off"]
        p50, p99, throughput = ratio.get("itl_p50"), ratio.get("itl_p99"), ratio.get("output_throughput")
        p50_limit = 1.0 / LOW_LOAD_GAIN if index == 0 else ITL_LIMIT
        checks.append({
            "level": level["level"],
            "ratios": ratio,
            "each": level.get("auto_vs_off_each", []),
            "itl_p50_limit": p50_limit,
            "itl_p50_met": None if p50 is None else p50 <= p50_limit,
            "itl_p99_met": None if p99 is None else p99 <= ITL_LIMIT,
            "saturation_throughput_met": (None if index != len(levels) - 1 or throughput is None
                                          else throughput >= 1.0),
        })
    return checks


def _mark(ok: bool | None) -> str:
    return "" if ok is None else (" ok" if ok else " MISSED")


def ratios_table(sweep: dict) -> str:
    rows = []
    any_repeated = any(level.get("auto_vs_off_each") for level in sweep["ratios"])
    for check in target_checks(sweep):
        ratio = check["ratios"]
        cells = [_fmt(ratio.get(name)) for name in RATIO_COLUMNS]
        cells[0] += _mark(check["saturation_throughput_met"])
        cells[2] += _mark(check["itl_p50_met"]) + f" (<= {check['itl_p50_limit']:.2f})"
        cells[3] += _mark(check["itl_p99_met"]) + f" (<= {ITL_LIMIT:.2f})"
        spread = " / ".join(",".join(_fmt(each.get(name)) for each in check["each"]) for name in SPREAD_COLUMNS)
        rows.append([str(check["level"]), *cells, *([spread] if any_repeated else [])])
    header = ["load", "output tok/s", "TTFT p50", "ITL p50", "ITL p99", "chunk ITL p50", "ITL p50 alone",
              "ITL p50 shared", "TPOT p50", "E2E p50"]
    if any_repeated:
        header.append("each repetition: tok/s / ITL p50 / ITL p99")
    return _table(header, rows)


def bound_table(sweep: dict) -> str:
    rows = []
    for level in sweep_bound(sweep):  # recomputed from the runs, so an older sweep.json gets today's bound
        single, batch = level["single_stream"], level["full_batch"]
        rows.append([str(level["level"]), _fmt(level["acceptance"]), str(single["k"]), _fmt(single["speedup"]),
                     _fmt(single["itl_p50_ratio"]), _fmt(single["itl_p99_ratio"]),
                     _fmt(single["unaccepted_token_share"]), _fmt(level.get("acceptance_for_itl_p99"), "{:.3f}"),
                     str(batch["k"]), _fmt(batch["speedup"])])
    header = ["load", "acceptance", "best k (1 seq)", "tok/s vs plain (1 seq)", "ITL p50 AUTO/OFF",
              "ITL p99 AUTO/OFF", "tokens from rounds accepting nothing", "acceptance for ITL p99 <= 1.02x",
              "best k (batch of 8)",
              "tok/s vs plain (batch of 8)"]
    return _table(header, rows)


def markdown(sweep: dict) -> str:
    return "\n\n".join([
        "### Runs\n\n" + runs_table(sweep),
        "### AUTO / OFF (ITL and latency: lower is better; throughput: higher is better)\n\n" + ratios_table(sweep),
        "### Analytic bound (server's measured costs, measured acceptance)\n\n" + bound_table(sweep),
    ])
