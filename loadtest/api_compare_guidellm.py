"""guidellm, the independent tool loadtest.api_compare checks the load tester against: one run against the HTTP API
(Guidellm), its JSON report read back per request by guidellm's own definitions (read_guidellm), and runs pooled
(guidellm_figures).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

from loadtest import metrics
from loadtest.prompts import Prompt


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
