"""The OpenAI-compatible HTTP API against gRPC on one server, and the load tester against an independent tool.

    python -m loadtest.api_compare --json docs/bench/api-compare.json --threads 2 --max-tokens 128 \\
        --concurrency 1 8 --repeats 2 --guidellm /tmp/glvenv/bin/guidellm

Starts one `tandem serve --in-process` (gRPC and HTTP on free loopback ports, metrics off; the models and dtype as
given, tandem's default pair in bfloat16 when not) and stops it at the end, on an error or Ctrl-C too. Then:

1. parity: each of the 8 shipped prompts (services/tandem/bench/prompts.jsonl, sent as one user chat message, as the
   other benchmarks do), greedy, streamed through the `openai` SDK (chat.completions.create(stream=True)) and through
   gRPC (tandem.client); the texts compared, one record per prompt, and the count equal (target 8/8);
2. latency: the load tester (loadtest's Python API) with backend grpc and backend openai on the same server and
   prompts, fixed concurrency C for each --concurrency, max(8, 2C) requests a run, every request exactly
   --max-tokens tokens (ignore_eos), the backends alternated per repeat (grpc openai, openai grpc, ...); each
   backend's repeats pooled (percentiles over all their samples, throughput over their summed durations): TTFT
   p50/p90, ITL p50/p90, output tok/s, and openai/grpc ratios (target: TTFT and ITL p50 within 1.1x);
3. with --guidellm: guidellm against the HTTP API at the same levels, same requests, same prompts in the same order,
   output fixed to --max-tokens, each guidellm run right beside a loadtest openai run (per repeat: grpc openai
   guidellm, then guidellm openai grpc); its TTFT and ITL p50 beside the load tester's, and the ratios (target:
   within 10%).

Writes the JSON to --json PATH (settings, machine, every run's figures, pooled figures, ratios, targets met or not), the
server's output to PATH.server.log, guidellm's raw JSON and logs to PATH.guidellm/; progress lines on stderr.
Exit status: 0 done (targets met or not: see the JSON), 1 the server or a tool failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import importlib.metadata
import json
import os
import platform
import signal
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import fields, replace
from importlib import resources
from pathlib import Path

import numpy as np

from loadtest import metrics, trace
from loadtest.client_run import run_level
from loadtest.config import RunConfig
from loadtest.prompts import Prompt, schedule
from tandem.cli.options import DefaultsHelpFormatter

BIN = Path(sys.executable).parent
SERVING = 1  # grpc.health.v1 HealthCheckResponse.SERVING
MIN_REQUESTS = 8
TOKEN_COUNT_MODE = next(f.default for f in fields(RunConfig) if f.name == "openai_token_counts")
API_TARGET = 1.1  # openai / grpc, TTFT and ITL p50
TOOL_TARGET = 0.10  # |guidellm / loadtest - 1|, TTFT and ITL p50
LOADTEST_FIGURES = (  # (name in the JSON, results key, statistic)
    ("ttft_p50", "ttft", "p50"), ("ttft_p90", "ttft", "p90"), ("itl_p50", "itl", "p50"), ("itl_p90", "itl", "p90"),
    ("tpot_p50", "tpot", "p50"), ("e2el_p50", "e2el", "p50"), ("output_throughput", "output_throughput", None),
)
API_RATIOS = ("ttft_p50", "ttft_p90", "itl_p50", "itl_p90", "tpot_p50", "e2el_p50", "output_throughput")


def log(message: str) -> None:
    print(f"[api_compare {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- prompts ------------------------------------------------------------------------------------------------------


def bench_prompts() -> list[Prompt]:
    """The 8 prompts of tandem.bench (services/tandem/bench/prompts.jsonl) as chat prompts: one user message each,
    the chat template applied by the server, as tandem.bench and tandem.bench.pools send them."""
    text = resources.files("tandem.bench").joinpath("prompts.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [Prompt(f"bench-{i + 1}", "chat", "short", messages=(("user", row["prompt"]),)) for i, row in
            enumerate(rows)]


def requests_for(concurrency: int, least: int = MIN_REQUESTS) -> int:
    return max(least, 2 * concurrency)


# --- the server ---------------------------------------------------------------------------------------------------


class Server:
    """`tandem serve --in-process` as a child process in a session of its own; stop() ends it (SIGTERM, then SIGKILL
    to its process group, which holds its embedded Redis) and is safe to call twice."""

    GRPC_LINE = "serving tandem.v1.GenerationService on "
    HTTP_LINE = "serving the OpenAI-compatible HTTP API on "

    def __init__(self, args: argparse.Namespace, log_path: Path, extra: list[str] = (), ca: str | None = None) -> None:
        """`extra`: more serve flags than args.serve_args; `ca`: the server speaks TLS with a certificate this PEM CA
        signed (the readiness checks connect with it)."""
        self.command = [str(BIN / "tandem"), "serve", "--in-process", "--host", "127.0.0.1", "--port", "0",
                        "--http-port", "0", "--no-metrics", "--dtype", args.dtype, "--grace", "5"]
        for flag, value in (("--target", args.target), ("--draft", args.draft), ("--threads", args.threads)):
            if value is not None:
                self.command += [flag, str(value)]
        self.command += args.serve_args.split() + list(extra)
        self.ca = ca
        self.log_path = log_path
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.address = ""
        self.url = ""
        self.process: subprocess.Popen | None = None
        self._found = threading.Event()

    def start(self, timeout: float) -> None:
        env = os.environ | {"TOKENIZERS_PARALLELISM": "false"}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(self.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, text=True, errors="replace",
                                        start_new_session=True)
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not self._found.wait(0.2):
            self._check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server announced no addresses within {timeout:g} s{self._tail()}")
        log(f"server pid {self.process.pid}: gRPC {self.address}, HTTP {self.url}; waiting for readiness")
        self._wait_ready(deadline, timeout)

    def _drain(self) -> None:
        with self.log_path.open("w") as sink:
            for line in self.process.stdout:
                sink.write(line)
                sink.flush()
                self.tail.append(line.rstrip())
                if self.GRPC_LINE in line:
                    self.address = line.split(self.GRPC_LINE)[1].split()[0]
                elif self.HTTP_LINE in line:
                    self.url = line.split(self.HTTP_LINE)[1].split()[0].removesuffix("/v1")
                if self.address and self.url:
                    self._found.set()

    def _tail(self) -> str:
        return "; its last output:\n" + "\n".join(self.tail) if self.tail else ""

    def _check_alive(self) -> None:
        if self.process.poll() is not None:
            time.sleep(0.3)  # let the reader thread catch the last lines
            raise RuntimeError(f"the server exited with status {self.process.returncode}{self._tail()}")

    def _wait_ready(self, deadline: float, timeout: float) -> None:
        import grpc
        import httpx

        from tandem.client import READINESS_SERVICE, TandemClient

        verify = ssl.create_default_context(cafile=self.ca) if self.ca else True
        with TandemClient(self.address, timeout=5, tls=self.ca is not None, root_certificates=self.ca) as client, \
                httpx.Client(trust_env=False, timeout=5, verify=verify) as http:
            while True:
                self._check_alive()
                with contextlib.suppress(grpc.RpcError, httpx.HTTPError):
                    if (client.health_status(READINESS_SERVICE) == SERVING
                            and http.get(f"{self.url}/health").status_code == 200):
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server was not ready within {timeout:g} s{self._tail()}")
                time.sleep(0.5)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        log(f"stopping the server (pid {process.pid})")
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def server_info(address: str) -> dict:
    from google.protobuf.json_format import MessageToDict

    from tandem.client import TandemClient

    with TandemClient(address, timeout=30) as client:
        info = MessageToDict(client.model_info(), preserving_proto_field_name=True)
    keep = ("target_model", "draft_model", "vocab_size", "max_k", "context_length", "draft_workers",
            "target_replicas")
    return {key: info[key] for key in keep if key in info}


# --- 1. parity ----------------------------------------------------------------------------------------------------


def parity(address: str, url: str, model: str, prompts: list[Prompt], max_tokens: int) -> dict:
    """Each prompt greedy through the openai SDK (streamed) and through gRPC; the texts compared."""
    import httpx
    import openai

    from tandem.client import TandemClient

    records = []
    with httpx.Client(trust_env=False, timeout=1800) as http, TandemClient(address, timeout=1800) as client:
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, http_client=http)
        for prompt in prompts:
            messages = [{"role": role, "content": content} for role, content in prompt.messages]
            grpc_result = client.generate_result(chat=messages, temperature=0.0, max_tokens=max_tokens)
            parts, finish, completion_tokens = [], None, None
            stream = sdk.chat.completions.create(model=model, messages=messages, temperature=0.0,
                                                 max_tokens=max_tokens, stream=True,
                                                 stream_options={"include_usage": True})
            for chunk in stream:
                for choice in chunk.choices:
                    parts.append(choice.delta.content or "")
                    finish = choice.finish_reason or finish
                if chunk.usage is not None:
                    completion_tokens = chunk.usage.completion_tokens
            text = "".join(parts)
            equal = text == grpc_result.text
            record = {"prompt": prompt.id, "equal": equal, "grpc_chars": len(grpc_result.text),
                      "openai_chars": len(text), "grpc_finish_reason": grpc_result.finish_reason,
                      "openai_finish_reason": finish, "grpc_completion_tokens": grpc_result.usage.completion_tokens,
                      "openai_completion_tokens": completion_tokens}
            if not equal:
                common = next((i for i, (a, b) in enumerate(zip(text, grpc_result.text, strict=False)) if a != b),
                              min(len(text), len(grpc_result.text)))
                record |= {"first_difference_at": common, "grpc_text": grpc_result.text, "openai_text": text}
            records.append(record)
            log(f"parity {prompt.id}: {'equal' if equal else 'DIFFERENT'} ({len(text)} chars, "
                f"{completion_tokens} tokens, {finish})")
    equal = sum(r["equal"] for r in records)
    return {"prompts": records, "equal": equal, "total": len(records), "target": f"{len(records)}/{len(records)}",
            "met": equal == len(records)}


# --- 2. the load tester, both backends ----------------------------------------------------------------------------


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


# --- 3. guidellm --------------------------------------------------------------------------------------------------


class Guidellm:
    """guidellm run against the HTTP API: concurrent profile, a JSON-lines file of the same chat messages in the load
    tester's order, a max_requests constraint; its JSON output read back per request."""

    def __init__(self, executable: str, url: str, model: str, speculation: str, max_tokens: int, work: Path) -> None:
        self.executable, self.url, self.model = executable, url, model
        self.speculation, self.max_tokens, self.work = speculation, max_tokens, work
        work.mkdir(parents=True, exist_ok=True)

    def version(self) -> str | None:
        python = Path(self.executable).parent / "python"
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            done = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('guidellm'))"],
                                  capture_output=True, text=True, timeout=60)
            if done.returncode == 0:
                return done.stdout.strip()
        return None

    def command(self, concurrency: int, requests: int, data: Path, output: Path) -> list[str]:
        backend = {"kind": "openai_http", "target": self.url, "model": self.model,
                   "request_format": "/v1/chat/completions", "timeout": 1800,
                   # the load tester's sampling fields; the output length comes from the data's output_tokens_count,
                   # for which guidellm itself sends max_completion_tokens, ignore_eos: true and stop: null
                   "extras": {"body": {"temperature": 0.0, "speculation": self.speculation}}}
        return [self.executable, "run", "--backend", json.dumps(backend),
                "--profile", json.dumps({"kind": "concurrent", "streams": concurrency}),
                "--data", json.dumps({"kind": "json_file", "path": str(data)}),
                "--constraint", json.dumps({"kind": "max_requests", "count": requests}),
                "--output", json.dumps({"kind": "json", "path": str(output)}),
                "--disable-console-interactive"]

    def run(self, concurrency: int, requests: int, prompts: list[Prompt], tag: str) -> dict:
        data, output, log_path = (self.work / f"{tag}{suffix}" for suffix in (".data.jsonl", ".json", ".log"))
        with data.open("w") as sink:
            for prompt in prompts:
                sink.write(json.dumps({"messages": [{"role": r, "content": c} for r, c in prompt.messages],
                                       "output_tokens_count": self.max_tokens}) + "\n")
        # loopback: no proxy from the environment; no hub access (its tokenizer is not needed for this data)
        env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
        env |= {"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost", "HF_HUB_OFFLINE": "1"}
        with log_path.open("w") as sink:
            done = subprocess.run(self.command(concurrency, requests, data, output), env=env, stdout=sink,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=3600)
        if done.returncode != 0 or not output.exists():
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"guidellm failed (status {done.returncode}); the end of {log_path}:\n{tail}")
        return read_guidellm(json.loads(output.read_text())) | {"json": str(output)}


def read_guidellm(report: dict) -> dict:
    """One guidellm benchmark: its own p50s (ms -> s) and its per-request values by its own definitions
    (TTFT = first token iteration - request start; ITL = (last - first token iteration) / (output tokens - 1)),
    kept for pooling with numpy's percentiles, as loadtest's."""
    (benchmark,) = report["benchmarks"]
    ok = benchmark["requests"]["successful"]
    ttfts, itls, tokens = [], [], 0
    for request in ok:
        timings = request["info"]["timings"]
        first, last, start = (timings.get(k) for k in ("first_token_iteration", "last_token_iteration",
                                                        "request_start"))
        count = (request.get("output_metrics") or {}).get("text_tokens") or 0
        tokens += count
        if first is not None and start is not None:
            ttfts.append(first - start)
        if first is not None and last is not None and count > 1:
            itls.append((last - first) / (count - 1))
    stats = benchmark["metrics"]

    def own(name: str) -> float | None:
        value = stats[name]["successful"]["percentiles"]["p50"]
        return value / 1000.0 if stats[name]["successful"]["count"] else None

    totals = stats["request_totals"]
    return {"completed": len(ok), "errored": totals.get("errored", 0), "incomplete": totals.get("incomplete", 0),
            "duration": benchmark["duration"], "total_output_tokens": tokens,
            "output_throughput": tokens / benchmark["duration"] if benchmark["duration"] else None,
            "own_ttft_p50": own("time_to_first_token_ms"), "own_itl_p50": own("inter_token_latency_ms"),
            "ttfts": ttfts, "itls": itls}


def guidellm_figures(runs: list[dict]) -> dict:
    """guidellm's runs pooled: percentiles over all their requests (numpy, as loadtest), throughput over the summed
    durations."""
    ttft = metrics.summarize([t for r in runs for t in r["ttfts"]])
    itl = metrics.summarize([t for r in runs for t in r["itls"]])
    duration = sum(r["duration"] for r in runs)
    tokens = sum(r["total_output_tokens"] for r in runs)
    return {"ttft_p50": ttft["p50"], "ttft_p90": ttft["p90"], "request_itl_p50": itl["p50"],
            "request_itl_p90": itl["p90"], "output_throughput": tokens / duration if duration else None,
            "completed": sum(r["completed"] for r in runs), "duration": duration, "total_output_tokens": tokens}


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


# --- the whole benchmark ------------------------------------------------------------------------------------------


def machine() -> dict:
    cpu = ""
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    versions = {}
    for package in ("torch", "transformers", "openai", "grpcio", "httpx"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"nproc": usable, "cpu_count": os.cpu_count(), "cpu": cpu, "platform": platform.platform(),
            "python": platform.python_version(), "torch": versions.get("torch"), "versions": versions}


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


def targets(body: dict) -> dict:
    """Every target, met or not (None where nothing was measured), and all of them together."""
    out = {"parity": body["parity"]["met"]}
    for level in body["latency"]["levels"]:
        c = level["concurrency"]
        for name, met in level["api_met"].items():
            out[f"c{c}_openai_over_grpc_{name}"] = met
        for name, met in level.get("guidellm_vs_loadtest", {}).get("met", {}).items():
            out[f"c{c}_guidellm_vs_loadtest_{name}"] = met
    out["all"] = all(v is True for v in out.values())
    return out


def add_server_options(parser: argparse.ArgumentParser) -> None:
    """The flags Server reads: which models, dtype and threads `tandem serve` gets, and any more of its flags."""
    parser.add_argument("--target", default=None, help="target model (default: tandem serve's)")
    parser.add_argument("--draft", default=None, help="draft model (default: tandem serve's)")
    parser.add_argument("--dtype", default="bfloat16", help="the servers' dtype")
    parser.add_argument("--threads", type=int, default=None, help="each server's torch threads (default: all cores)")
    parser.add_argument("--serve-args", default="", help="more `tandem serve` flags, one string")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.api_compare", description=__doc__.splitlines()[0],
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--json", type=Path, required=True, metavar="PATH",
                        help="the JSON report; the servers' logs go beside it")
    add_server_options(parser)
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="requests in flight, one level each")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each backend per level, alternated")
    parser.add_argument("--min-requests", type=int, default=MIN_REQUESTS,
                        help="requests a run at the least (a run sends max(this, 2 x concurrency))")
    parser.add_argument("--speculation", choices=("auto", "off"), default="auto", help="the requests' speculation mode")
    parser.add_argument("--warmup", type=int, default=1, help="loadtest warm-up requests per run (not measured)")
    parser.add_argument("--seed", type=int, default=0, help="the prompt order of every run")
    parser.add_argument("--timeout", type=float, default=1800.0, help="per-request deadline, seconds")
    parser.add_argument("--ready-timeout", type=float, default=1800.0,
                        help="seconds for the server to load (and pull) its models")
    parser.add_argument("--guidellm", default=None, help="a guidellm executable: also run it against the HTTP API")
    args = parser.parse_args(argv)
    checks = [("max_tokens", args.max_tokens >= 2, "must be at least 2"),
              ("concurrency", all(c >= 1 for c in args.concurrency), "must be at least 1"),
              ("repeats", args.repeats >= 1, "must be at least 1"),
              ("warmup", args.warmup >= 0, "must not be negative")]
    for name, ok, message in checks:
        if not ok:
            parser.error(f"{name}: {message}, got {getattr(args, name)!r}")
    if args.guidellm is not None and not os.access(args.guidellm, os.X_OK):
        parser.error(f"guidellm: {args.guidellm} is not an executable")
    return args


def _terminate(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally that stops the server


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    started = time.time()
    prompts = bench_prompts()
    server = Server(args, args.json.with_name(args.json.name + ".server.log"))
    body: dict = {
        "command": "python -m loadtest.api_compare " + " ".join(sys.argv[1:] if argv is None else argv),
        "settings": {"target": args.target, "draft": args.draft, "dtype": args.dtype, "threads": args.threads,
                     "serve_command": server.command, "max_tokens": args.max_tokens,
                     "concurrency": args.concurrency, "repeats": args.repeats, "speculation": args.speculation,
                     "warmup": args.warmup, "seed": args.seed, "requests_per_run": {
                         str(c): requests_for(c, args.min_requests) for c in args.concurrency},
                     "prompts": [p.id for p in prompts], "prompt_source": "services/tandem/bench/prompts.jsonl, "
                     "each as one user chat message", "latency_requests": "greedy, ignore_eos: every request "
                     f"{args.max_tokens} tokens", "openai_token_counts": TOKEN_COUNT_MODE,
                     "guidellm": args.guidellm},
        "machine": machine(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
    }
    try:
        log(f"starting: {' '.join(server.command)}")
        server.start(args.ready_timeout)
        info = server_info(server.address)
        body["server"] = info | {"grpc": server.address, "http": server.url, "log": str(server.log_path)}
        model = info.get("target_model", "")
        log(f"ready: target {model}, draft {info.get('draft_model', '')}")
        body["parity"] = parity(server.address, server.url, model, prompts, args.max_tokens)
        tool = None
        if args.guidellm is not None:
            tool = Guidellm(args.guidellm, server.url, model, args.speculation, args.max_tokens,
                            args.json.with_name(args.json.name + ".guidellm"))
            body["guidellm"] = {
                "executable": args.guidellm, "version": tool.version(),
                "data": "the same chat messages as the load tester, in its order (json_file, messages column)",
                "output_tokens": f"fixed: output_tokens_count {args.max_tokens} per row, for which guidellm sends "
                                 "max_completion_tokens, ignore_eos: true and stop: null",
                "extra_body": {"temperature": 0.0, "speculation": args.speculation},
                "differences": "guidellm sends no session_id (the load tester one per request) and no "
                               "return_token_ids (it counts output tokens from usage); no warm-up request",
                "itl_definition": "guidellm's ITL is per request: (last - first token chunk) / (output tokens - 1); "
                                  "compared with the same quantity from the load tester's traces "
                                  "(request_itl_p50); the load tester's per-token itl_p50 is listed beside it",
                "percentiles": "pooled over the repeats' requests with numpy's linear interpolation, as "
                               "loadtest's; guidellm's own p50s per run are under own_ttft_p50/own_itl_p50"}
        body["latency"] = run_levels(args, server, prompts, tool)
        body["targets"] = targets(body)
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        log(f"error: {exc}")
        body["error"] = str(exc)
        _write(args.json, body, started)
        return 1
    finally:
        server.stop()
    _write(args.json, body, started)
    log(f"wrote {args.json}: parity {body['parity']['equal']}/{body['parity']['total']}, all targets met: "
        f"{body['targets']['all']}")
    return 0


def _write(path: Path, body: dict, started: float) -> None:
    body["seconds"] = round(time.time() - started, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=2, allow_nan=False, default=_jsonable) + "\n")


def _jsonable(value):
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


if __name__ == "__main__":
    sys.exit(main())
