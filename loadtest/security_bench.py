"""What security costs and what it closes: TLS + API keys against plaintext, and the cross-tenant timing channel.

    python -m loadtest.security_bench --json docs/bench/security-tls-cost.json --part cost \\
        --target DIR --draft DIR --concurrency 8 --repeats 3
    python -m loadtest.security_bench --json docs/bench/security-tenant-timing.json --part timing --threads 2

1. cost: two `tandem serve --in-process` on loopback with the same models and flags, one plaintext without keys,
   one with TLS (a CA and server certificate made here, ECDSA P-256) and --api-keys; the load tester at a fixed
   concurrency through gRPC and through the OpenAI HTTP API against each, the servers alternated per repeat
   (plain secured, secured plain, ...), each side's repeats pooled; secured/plain ratios of TTFT, ITL and
   end-to-end latency p50 (target: request latency within 2% at 8 in flight). Only one server works at a time.
2. timing: one server with keys for a victim and an attacker tenant. Per shipped prompt (one user chat message):
   the victim sends it with a session id (cold: a full prefill), then again (warm: its retained KV is reused, the
   channel that exists for the owner), then the attacker sends the same prompt with the same session id and, in
   alternated order, with a fresh one (the cold control). Each request asks for one token; its time to first token
   is read. Reported: medians and attacker-same-session / attacker-fresh (target: no faster, ratio >= 0.9 within
   noise) beside victim-warm / victim-cold (how much faster a cross-tenant hit would have been).

Writes the JSON to --json PATH; server logs beside it. Exit status 0 done, 1 a server failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from loadtest import trace
from loadtest.api_compare import bench_prompts
from loadtest.api_compare_latency import figures, ratio
from loadtest.bench_server import Server, add_server_options, log, machine
from loadtest.client_run import run_level
from loadtest.config import RunConfig
from loadtest.prompts import Prompt
from tandem.cli.options import DefaultsHelpFormatter

COST_TARGET = 1.02  # secured / plain request latency p50 at 8 in flight
TIMING_TARGET = 0.9  # attacker on the victim's session id / attacker cold: not faster than this
COST_FIGURES = ("ttft_p50", "itl_p50", "e2el_p50", "output_throughput")


def make_pki(out: Path) -> dict[str, str]:
    """A CA and a server certificate it signed for 127.0.0.1 (ECDSA P-256), made with the openssl command."""
    files = {name: str(out / name) for name in ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem")}
    ext = out / "server.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    steps = [
        ["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
         "-subj", "/CN=tandem-bench-ca", "-keyout", files["ca.key"], "-out", files["ca.pem"]],
        ["req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-subj", "/CN=127.0.0.1", "-keyout", files["server.key"], "-out", files["server.csr"]],
        ["x509", "-req", "-in", files["server.csr"], "-CA", files["ca.pem"], "-CAkey", files["ca.key"],
         "-CAcreateserial", "-days", "1", "-extfile", str(ext), "-out", files["server.pem"]],
    ]
    for step in steps:
        subprocess.run(["openssl", *step], check=True, capture_output=True)
    return {"ca_path": files["ca.pem"], "server_cert_path": files["server.pem"], "server_key_path": files["server.key"]}


def make_keys(path: Path, tenants: tuple[str, ...]) -> dict[str, str]:
    from tandem.gateway.auth import create_key

    return {tenant: create_key(path, tenant) for tenant in tenants}


# --- 1. what TLS and keys cost ------------------------------------------------------------------------------------


def cost(args: argparse.Namespace, work: Path, prompts: list[Prompt]) -> dict:
    pki = make_pki(work)
    keys = make_keys(work / "keys.jsonl", ("bench",))
    plain = Server(args, args.json.with_name(args.json.name + ".plain.log"))
    secured = Server(args, args.json.with_name(args.json.name + ".secured.log"),
                     extra=["--tls-cert", pki["server_cert_path"], "--tls-key", pki["server_key_path"],
                            "--api-keys", str(work / "keys.jsonl")], ca=pki["ca_path"])
    servers = {"plain": plain, "secured": secured}
    try:
        for name, server in servers.items():
            log(f"starting the {name} server: {' '.join(server.command)}")
            server.start(args.ready_timeout)
        requests = max(args.min_requests, 2 * args.concurrency)
        base = RunConfig(address=plain.address, requests=requests, concurrency=args.concurrency, seed=args.seed,
                         warmup=args.warmup, prompts="chat", max_tokens=args.max_tokens, temperature=0.0,
                         ignore_eos=True, timeout=args.timeout)
        traces: dict[tuple[str, str], list[trace.RunTrace]] = {}
        runs = []
        for repeat in range(args.repeats):
            order = ("plain", "secured") if repeat % 2 == 0 else ("secured", "plain")
            for backend in ("grpc", "openai"):
                for name in order:
                    config = _config(base, backend, servers[name], keys["bench"] if name == "secured" else None,
                                     pki["ca_path"] if name == "secured" else None)
                    run = asyncio.run(run_level(config, prompts))
                    traces.setdefault((backend, name), []).append(run)
                    f = figures(run)
                    log(f"repeat {repeat + 1}/{args.repeats} {backend} {name}: {f['completed']}/{f['requests']} ok, "
                        f"TTFT p50 {_ms(f['ttft_p50'])}, ITL p50 {_ms(f['itl_p50'])}, e2e p50 {_ms(f['e2el_p50'])}")
                    runs.append({"repeat": repeat + 1, "backend": backend, "server": name,
                                 "figures": {k: f[k] for k in (*COST_FIGURES, "completed", "failed", "requests")}})
    finally:
        for server in servers.values():
            server.stop()
    out: dict = {"concurrency": args.concurrency, "requests_per_run": requests, "runs": runs, "backends": {}}
    for backend in ("grpc", "openai"):
        pooled = {name: figures(trace.concatenate(traces[(backend, name)])) for name in servers}
        ratios = {k: ratio(pooled["secured"][k], pooled["plain"][k]) for k in COST_FIGURES}
        out["backends"][backend] = {
            "pooled": {name: {k: f[k] for k in COST_FIGURES} for name, f in pooled.items()},
            "secured_over_plain": ratios,
            "met": {k: ratios[k] is not None and ratios[k] <= COST_TARGET for k in ("ttft_p50", "e2el_p50")}}
        log(f"{backend}: secured/plain TTFT p50 {_fmt(ratios['ttft_p50'])}, ITL p50 {_fmt(ratios['itl_p50'])}, "
            f"e2e p50 {_fmt(ratios['e2el_p50'])}")
    out["target"] = f"secured/plain TTFT and end-to-end latency p50 <= {COST_TARGET}"
    return out


def _config(base: RunConfig, backend: str, server: Server, key: str | None, ca: str | None) -> RunConfig:
    if backend == "openai":
        return replace(base, backend="openai", url=server.url, ca=ca, api_key=key)
    return replace(base, backend="grpc", address=server.address, tls=ca is not None, ca=ca, api_key=key)


# --- 2. the cross-tenant timing channel ---------------------------------------------------------------------------


def timing(args: argparse.Namespace, work: Path, prompts: list[Prompt]) -> dict:
    from tandem.client import TandemClient

    keys = make_keys(work / "keys.jsonl", ("victim", "attacker"))
    server = Server(args, args.json.with_name(args.json.name + ".timing.log"),
                    extra=["--api-keys", str(work / "keys.jsonl")])
    records = []
    try:
        log(f"starting the server: {' '.join(server.command)}")
        server.start(args.ready_timeout)
        with TandemClient(server.address, api_key=keys["victim"], timeout=args.timeout) as victim, \
                TandemClient(server.address, api_key=keys["attacker"], timeout=args.timeout) as attacker:
            for index, prompt in enumerate(prompts[:args.trials]):
                chat = [{"role": role, "content": content} for role, content in prompt.messages]
                session = f"victim-{index}"
                record = {"prompt": prompt.id, "victim_cold": _ttft(victim, chat, session),
                          "victim_warm": _ttft(victim, chat, session)}
                order = ("same", "fresh") if index % 2 == 0 else ("fresh", "same")
                for which in order:
                    sid = session if which == "same" else f"attacker-{index}"
                    record[f"attacker_{which}_session"] = _ttft(attacker, chat, sid)
                log(f"{prompt.id}: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in record.items() if k != "prompt"))
                records.append(record)
    finally:
        server.stop()
    medians = {name: statistics.median(r[name] for r in records)
               for name in ("victim_cold", "victim_warm", "attacker_same_session", "attacker_fresh_session")}
    same_over_fresh = ratio(medians["attacker_same_session"], medians["attacker_fresh_session"])
    each = [ratio(r["attacker_same_session"], r["attacker_fresh_session"]) for r in records]
    return {"trials": records, "medians": medians,
            "victim_warm_over_cold": ratio(medians["victim_warm"], medians["victim_cold"]),
            "attacker_same_over_fresh": same_over_fresh, "attacker_same_over_fresh_each": each,
            "target": f"attacker same-session / fresh-session TTFT median >= {TIMING_TARGET}",
            "met": same_over_fresh is not None and same_over_fresh >= TIMING_TARGET}


def _ttft(client, chat: list[dict], session_id: str) -> float:
    start = time.perf_counter()
    stream = client.generate(chat=chat, session_id=session_id, max_tokens=1, temperature=0.0)
    try:
        next(stream)
        return time.perf_counter() - start
    finally:
        for _ in stream:  # drain: the request ends normally (its session keeps its cache)
            pass


# --- the whole benchmark ------------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.security_bench", description=__doc__.splitlines()[0],
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--json", type=Path, required=True, metavar="PATH",
                        help="the JSON report; the servers' logs go beside it")
    parser.add_argument("--part", choices=("cost", "timing", "both"), default="both", help="what to measure")
    add_server_options(parser)
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--concurrency", type=int, default=8, help="cost: requests in flight")
    parser.add_argument("--repeats", type=int, default=3, help="cost: runs of each server, alternated")
    parser.add_argument("--min-requests", type=int, default=16, help="requests a cost run at the least")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up requests per run (not measured)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trials", type=int, default=8, help="timing: prompts tried (at most the 8 shipped)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="per-request deadline, seconds")
    parser.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds a server may take to turn ready")
    args = parser.parse_args(argv)
    for name in ("max_tokens", "concurrency", "repeats", "trials"):
        if getattr(args, name) < 1:
            parser.error(f"{name}: must be at least 1, got {getattr(args, name)}")
    return args


def _terminate(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop the servers


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    started = time.time()
    prompts = bench_prompts()
    body: dict = {"command": "python -m loadtest.security_bench " + " ".join(sys.argv[1:] if argv is None else argv),
                  "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                  "machine": machine(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))}
    status = 0
    with tempfile.TemporaryDirectory(prefix="tandem-security-bench-") as tmp:
        try:
            if args.part in ("cost", "both"):
                (Path(tmp) / "cost").mkdir()
                body["cost"] = cost(args, Path(tmp) / "cost", prompts)
            if args.part in ("timing", "both"):
                (Path(tmp) / "timing").mkdir()
                body["timing"] = timing(args, Path(tmp) / "timing", prompts)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            log(f"error: {exc}")
            body["error"] = str(exc)
            status = 1
    body["seconds"] = round(time.time() - started, 1)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(body, indent=2) + "\n")
    log(f"wrote {args.json}")
    return status


if __name__ == "__main__":
    sys.exit(main())
