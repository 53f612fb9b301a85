"""loadtest.api_compare's latency part: the load tester with backend grpc and backend openai at each concurrency
level, the backends alternated per repeat (guidellm beside the openai runs when given), each run's figures, each
backend's repeats pooled, and the ratios against their targets (openai / grpc; guidellm / loadtest).
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import replace

from loadtest import metrics, trace
from loadtest.api_compare_guidellm import Guidellm, guidellm_figures
from loadtest.bench_server import Server, log
from loadtest.client_run import run_level
from loadtest.config import RunConfig
from loadtest.prompts import Prompt, schedule

MIN_REQUESTS = 8
API_TARGET = 1.1  # openai / grpc, TTFT and ITL p50
TOOL_TARGET = 0.10  # |guidellm / loadtest - 1|, TTFT and ITL p50
LOADTEST_FIGURES = (  # (name in the JSON, results key, statistic)
    ("ttft_p50", "ttft", "p50"), ("ttft_p90", "ttft", "p90"), ("itl_p50", "itl", "p50"), ("itl_p90", "itl", "p90"),
    ("tpot_p50", "tpot", "p50"), ("e2el_p50", "e2el", "p50"), ("output_throughput", "output_throughput", None),
)
API_RATIOS = ("ttft_p50", "ttft_p90", "itl_p50", "itl_p90", "tpot_p50", "e2el_p50", "output_throughput")


def requests_for(concurrency: int, least: int = MIN_REQUESTS) -> int:
    return max(least, 2 * concurrency)


def request_itls(run: trace.RunTrace) -> list[float]:
    """guidellm's ITL per completed request: (last token chunk - first token chunk) / (output tokens - 1)."""
    return [(r.chunk_times[-1] - r.chunk_times[0]) / (r.output_tokens - 1)
            for r in run.by_status(trace.OK) if r.output_tokens > 1 and r.chunk_times]


def figures(run: trace.RunTrace) -> dict:
    """One run's (or a pool's) figures: loadtest.metrics' results, the compared quantities picked out, seconds."""
    results = metrics.compute(run)
    out = {name: (results[key][stat] if stat else results[key]) for name, key, stat in LOADTEST_FIGURES}
    request_itl = metrics.summarize(request_itls(run))
    out |= {"request_itl_p50": request_itl["p50"], "request_itl_p90": request_itl["p90"]}
    keep = ("requests", "completed", "failed", "error_kinds", "duration", "total_output_tokens", "tokens_per_chunk",
            "acceptance_rate")
    return out | {key: results[key] for key in keep}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def api_ratios(openai_figures: dict, grpc_figures: dict) -> dict:
    return {name: ratio(openai_figures[name], grpc_figures[name]) for name in API_RATIOS}


def loadtest_run(base: RunConfig, backend: str, server: Server, prompts: list[Prompt]) -> trace.RunTrace:
    if backend == "openai":
        config = replace(base, backend="openai", address="", url=server.url)
    else:
        config = replace(base, backend="grpc", address=server.address, url="")
    return asyncio.run(run_level(config, prompts))


def describe(name: str, f: dict) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.1f}"

    return (f"{name}: {f['completed']}/{f['requests']} ok, TTFT p50 {ms(f['ttft_p50'])} ms, ITL p50 "
            f"{ms(f['itl_p50'])} ms, per-request ITL p50 {ms(f['request_itl_p50'])} ms, "
            f"{f['output_throughput'] or 0:.1f} tok/s")


def tool_comparison(guidellm: dict, loadtest: dict) -> dict:
    """guidellm / loadtest openai at one level: TTFT p50 and the per-request ITL p50 (guidellm's ITL definition,
    computed from the load tester's traces), within TOOL_TARGET; the load tester's per-token ITL p50 alongside."""
    ratios = {"ttft_p50": ratio(guidellm["ttft_p50"], loadtest["ttft_p50"]),
              "itl_p50": ratio(guidellm["request_itl_p50"], loadtest["request_itl_p50"]),
              "output_throughput": ratio(guidellm["output_throughput"], loadtest["output_throughput"])}
    met = {name: None if ratios[name] is None else abs(ratios[name] - 1) <= TOOL_TARGET
           for name in ("ttft_p50", "itl_p50")}
    return {"guidellm": {k: guidellm[k] for k in ("ttft_p50", "request_itl_p50", "output_throughput")},
            "loadtest_openai": {k: loadtest[k] for k in ("ttft_p50", "request_itl_p50", "itl_p50",
                                                        "output_throughput")},
            "guidellm_over_loadtest": ratios, "target": f"within {TOOL_TARGET:.0%}", "met": met}


def schedule_for(repeat: int, with_tool: bool) -> list[str]:
    """grpc openai [guidellm], then [guidellm] openai grpc, ...: each backend as often first as last, and guidellm
    always right beside a loadtest openai run."""
    order = ["grpc", "openai"] + (["guidellm"] if with_tool else [])
    return order if repeat % 2 == 0 else order[::-1]


def run_levels(args: argparse.Namespace, server: Server, prompts: list[Prompt], tool: Guidellm | None) -> dict:
    levels = []
    for concurrency in args.concurrency:
        requests = requests_for(concurrency, args.min_requests)
        base = RunConfig(address=server.address, requests=requests, concurrency=concurrency, seed=args.seed,
                         warmup=args.warmup, speculation=args.speculation, prompts="chat",
                         max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, timeout=args.timeout)
        # the prompts every run sends, in order (loadtest's seeded schedule after its warm-up): guidellm gets these
        measured = schedule(prompts, requests + args.warmup, args.seed)[args.warmup:]
        traces: dict[str, list[trace.RunTrace]] = {"grpc": [], "openai": []}
        tool_runs: list[dict] = []
        runs = []
        for repeat in range(args.repeats):
            for name in schedule_for(repeat, tool is not None):
                log(f"concurrency {concurrency}, repeat {repeat + 1}/{args.repeats}: {name}, {requests} requests")
                if name == "guidellm":
                    result = tool.run(concurrency, requests, measured, f"c{concurrency}-r{repeat + 1}")
                    tool_runs.append(result)
                    summary = {k: v for k, v in result.items() if k not in ("ttfts", "itls")}
                    summary |= guidellm_figures([result])
                    log(f"guidellm: {result['completed']}/{requests} ok, TTFT p50 "
                        f"{(summary['ttft_p50'] or 0) * 1000:.1f} ms, per-request ITL p50 "
                        f"{(summary['request_itl_p50'] or 0) * 1000:.1f} ms")
                    runs.append({"tool": "guidellm", "repeat": repeat + 1, "figures": summary})
                    continue
                run = loadtest_run(base, name, server, prompts)
                traces[name].append(run)
                f = figures(run)
                log(describe(name, f))
                runs.append({"tool": "loadtest", "backend": name, "repeat": repeat + 1, "figures": f})
        pooled = {name: figures(trace.concatenate(runs_)) for name, runs_ in traces.items()}
        ratios = api_ratios(pooled["openai"], pooled["grpc"])
        each = [api_ratios(figures(o), figures(g)) for o, g in zip(traces["openai"], traces["grpc"], strict=True)]
        met = {name: None if ratios[name] is None else ratios[name] <= API_TARGET for name in ("ttft_p50", "itl_p50")}
        level = {"concurrency": concurrency, "requests": requests, "runs": runs, "pooled": pooled,
                 "openai_over_grpc": ratios, "openai_over_grpc_each": each,
                 "api_target": f"openai/grpc <= {API_TARGET}", "api_met": met}
        if tool is not None:
            level["guidellm_pooled"] = guidellm_figures(tool_runs)
            level["guidellm_vs_loadtest"] = tool_comparison(level["guidellm_pooled"], pooled["openai"])
            level["guidellm_vs_loadtest_each"] = [
                tool_comparison(guidellm_figures([g]), figures(o))["guidellm_over_loadtest"]
                for g, o in zip(tool_runs, traces["openai"], strict=True)]
        line = f"concurrency {concurrency}: openai/grpc TTFT p50 {_fmt(ratios['ttft_p50'])}, ITL p50 " \
               f"{_fmt(ratios['itl_p50'])}"
        if tool is not None:
            tool_ratios = level["guidellm_vs_loadtest"]["guidellm_over_loadtest"]
            line += f"; guidellm/loadtest TTFT p50 {_fmt(tool_ratios['ttft_p50'])}, ITL p50 " \
                    f"{_fmt(tool_ratios['itl_p50'])}"
        log(line)
        levels.append(level)
    return {"levels": levels}


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
