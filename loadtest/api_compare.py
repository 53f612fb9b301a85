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

The server is loadtest/bench_server.py's, the latency runs and their figures loadtest/api_compare_latency.py's, and
guidellm's runs loadtest/api_compare_guidellm.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import fields
from importlib import resources
from pathlib import Path

import numpy as np

from loadtest.api_compare_guidellm import Guidellm
from loadtest.api_compare_latency import MIN_REQUESTS, requests_for, run_levels
from loadtest.bench_server import Server, add_server_options, log, machine, server_info
from loadtest.config import RunConfig
from loadtest.prompts import Prompt
from tandem.cli.options import DefaultsHelpFormatter

TOKEN_COUNT_MODE = next(f.default for f in fields(RunConfig) if f.name == "openai_token_counts")


# --- prompts ------------------------------------------------------------------------------------------------------


def bench_prompts() -> list[Prompt]:
    """The 8 prompts of tandem.bench (services/tandem/bench/prompts.jsonl) as chat prompts: one user message each,
    the chat template applied by the server, as tandem.bench and tandem.bench.pools send them."""
    text = resources.files("tandem.bench").joinpath("prompts.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [Prompt(f"bench-{i + 1}", "chat", "short", messages=(("user", row["prompt"]),)) for i, row in
            enumerate(rows)]


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


# --- the whole benchmark ------------------------------------------------------------------------------------------


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
