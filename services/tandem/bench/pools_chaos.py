"""Shared pools under chaos: the draft pool scaled, and a gateway SIGKILLed, while greedy streams run.

A Ray head on loopback (or --ray-address), `tandem pools start` with one draft worker and one target replica, and
`tandem gateway` processes. scale: N concurrent streams on one gateway; --scale-after s after the first token,
`tandem pools scale draft 2`, a `pools status` (where the sequences are), and after --scale-hold s back to 1.
gateway_kill: N streams split over two gateways; --kill-after s after the first token one is SIGKILLed (the other's
streams should complete; the workers' pids should not change). Each stream's greedy ids are compared with its prompt
run afterwards with speculation off through a surviving gateway. Reported, never asserted: completed / failed (with
errors), identical_to_plain, event times and the share of requested tokens delivered before each. JSON on stdout
(and --json PATH); the real pair:

    python -m tandem.bench.pools_chaos --sessions 16 --max-tokens 64 --json docs/bench/pools-chaos-v1.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from loadtest.prompts import Prompt, load_set
from tandem.bench.local_cluster import (
    BIN,
    pools_status,
    ray_env,
    run_tandem,
    start_gateway,
    start_ray_head,
)
from tandem.cli.common import DEFAULT_DRAFT, DEFAULT_TARGET
from tandem.cli.options import DefaultsHelpFormatter, add_json_option, wants_text, write_json
from tandem.client import TandemClient
from tandem.sessions import EmbeddedRedis

POOLS = "chaos"
SPEC_COUNTS = ("rounds", "fallback_rounds", "drafted_tokens", "accepted_tokens", "draft_failures")
DTYPE_NOTE = ("greedy identity with plain decoding holds in float32 only: in bfloat16 a batched verify forward "
              "rounds differently from a plain decode step, so some streams may diverge without any fault")


@dataclass
class Stream:
    index: int
    gateway: str
    prompt: Prompt
    ids: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # each token's arrival, seconds from the load's start
    outcome: str = "running"  # completed or failed; still running if the join timed out
    error: str = ""
    ended: float | None = None
    spec: dict[str, int] = field(default_factory=dict)  # the Complete's speculation counts


def _workers(address: str) -> dict[str, dict]:
    return {w["name"]: w for w in pools_status(address, POOLS, timeout=120)["workers"]}


def _load(jobs: list[tuple[str, str, Prompt]], args: argparse.Namespace, speculation: str, tag: str,
          first_token: threading.Event | None = None) -> tuple[list[Stream], float, list[threading.Thread]]:
    """One streaming greedy request per job (gateway address, label, prompt), each its own session; not waited for."""
    started = time.monotonic()
    streams = [Stream(i, label, prompt) for i, (_, label, prompt) in enumerate(jobs)]

    def one(stream: Stream, address: str) -> None:
        try:
            with TandemClient(address, timeout=args.stream_timeout) as client:
                for item in client.generate(**stream.prompt.request_input(), temperature=0.0, ignore_eos=True,
                                            max_tokens=args.max_tokens, speculation=speculation,
                                            session_id=f"{tag}-{speculation}-{stream.index}"):
                    if hasattr(item, "token_ids"):  # a Chunk; the Complete has none
                        stream.ids += item.token_ids
                        stream.times += [time.monotonic() - started] * len(item.token_ids)
                        if first_token is not None and item.token_ids:
                            first_token.set()
                    else:  # draft_failures: rounds decoded plainly because a draft worker failed
                        stream.spec = {k: getattr(item.speculation, k) for k in SPEC_COUNTS}
            short = len(stream.ids) != args.max_tokens
            stream.outcome, stream.error = ("failed", f"{len(stream.ids)} tokens") if short else ("completed", "")
        except grpc.RpcError as exc:
            stream.outcome, stream.error = "failed", f"{exc.code().name}: {exc.details()}"
        except Exception as exc:  # a stream's failure is a figure here, not a reason to stop
            stream.outcome, stream.error = "failed", repr(exc)
        stream.ended = time.monotonic() - started
        if first_token is not None:  # a load whose streams all fail at once must not hold the event back
            first_token.set()

    threads = [threading.Thread(target=one, args=(s, job[0]), daemon=True)
               for s, job in zip(streams, jobs, strict=True)]
    for thread in threads:
        thread.start()
    return streams, started, threads


def _join(threads: list[threading.Thread], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))


def _plain(address: str, streams: list[Stream], args: argparse.Namespace, tag: str) -> dict[int, list[int]]:
    """The streams' prompts again with speculation off, all at once: stream index -> plain greedy ids."""
    reference, _, threads = _load([(address, s.gateway, s.prompt) for s in streams], args, "off", tag)
    _join(threads, args.stream_timeout + 30)
    return {s.index: r.ids for s, r in zip(streams, reference, strict=True) if r.outcome == "completed"}


def _wait_then(first_token: threading.Event, delay: float, started: float) -> float:
    # Timed from the first token, not the start: prefill and a cold first round vary too much for a fixed time.
    first_token.wait(timeout=600)
    time.sleep(delay)
    return time.monotonic() - started


def _at(streams: list[Stream], t: float, max_tokens: int) -> dict:
    """Where the load stood at t: tokens delivered before (and their share of all requested) and after, streams live."""
    before = sum(x < t for s in streams for x in s.times)
    return {"t_s": round(t, 3), "tokens_before": before, "tokens_after": sum(len(s.times) for s in streams) - before,
            "fraction_before": round(before / max(1, max_tokens * len(streams)), 3),
            "streams_running": sum(1 for s in streams if s.ended is None or s.ended > t)}


def _summary(streams: list[Stream], plain: dict[int, list[int]] | None) -> dict:
    same = [plain is not None and s.outcome == "completed" and s.ids == plain.get(s.index) for s in streams]
    ends = [s.ended for s in streams]
    return {"streams": len(streams), "completed": sum(s.outcome == "completed" for s in streams),
            "failed": sum(s.outcome == "failed" for s in streams),
            "unfinished": sum(s.outcome == "running" for s in streams),
            "identical_to_plain": sum(same) if plain is not None else None,
            "plain_failed": None if plain is None else len(streams) - len(plain),
            "tokens": sum(len(s.ids) for s in streams),
            **{k: sum(s.spec.get(k, 0) for s in streams) for k in SPEC_COUNTS},
            "wall_s": None if None in ends else round(max(ends), 3),  # the load's start to its last stream's end
            "errors": sorted({s.error for s in streams if s.error}),
            "per_stream": [{"index": s.index, "prompt": s.prompt.id, "outcome": s.outcome, "tokens": len(s.ids),
                            "identical_to_plain": ok if plain is not None else None,
                            "ended_s": None if s.ended is None else round(s.ended, 3),
                            **({"error": s.error} if s.error else {})} for s, ok in zip(streams, same, strict=True)]}


def scale(address: str, gateways: list[str], prompts: list[Prompt], args: argparse.Namespace) -> dict:
    first = threading.Event()
    streams, started, threads = _load([(gateways[0], "g0", p) for p in prompts], args, "auto", "scale", first)
    events = {"scale_up": _wait_then(first, args.scale_after, started)}
    run_tandem(address, "pools", "scale", "--name", POOLS, "draft", "2")
    events["scale_up_done"] = time.monotonic() - started
    hold = threading.Thread(target=time.sleep, args=(args.scale_hold,))  # gateways see new members within 2 s
    hold.start()
    at_two = _workers(address)  # where the sequences are while two draft workers serve
    events["status_at_two"] = time.monotonic() - started
    hold.join()
    events["scale_down"] = time.monotonic() - started
    run_tandem(address, "pools", "scale", "--name", POOLS, "draft", "1")
    events["scale_down_done"] = time.monotonic() - started  # the removed worker is killed just before this
    _join(threads, args.stream_timeout)
    plain_began = time.monotonic()
    plain = _plain(gateways[0], streams, args, "scale")
    return {**_summary(streams, plain), "plain_wall_s": round(time.monotonic() - plain_began, 3),
            "events": {name: _at(streams, t, args.max_tokens) for name, t in events.items()},
            "at_two_drafts": {n: {k: w.get(k) for k in ("sequences", "kv_tokens_used")} for n, w in at_two.items()},
            "worker_pids_after": {n: w.get("pid") for n, w in _workers(address).items()}}


def gateway_kill(address: str, gateways: list[str], prompts: list[Prompt], args: argparse.Namespace,
                 victim: subprocess.Popen, pids_before: dict | None = None) -> dict:
    """gateways[1] (process `victim`) is killed; gateways[0] survives. `pids_before`: the workers' pids if known (a
    status call costs seconds of CLI start-up)."""
    pids_before = pids_before or {n: w.get("pid") for n, w in _workers(address).items()}
    first = threading.Event()
    jobs = [(gateways[i % 2], "survivor" if i % 2 == 0 else "killed", p) for i, p in enumerate(prompts)]
    streams, started, threads = _load(jobs, args, "auto", "kill", first)
    killed_at = _wait_then(first, args.kill_after, started)
    victim.kill()
    victim.wait(timeout=60)
    _join(threads, args.stream_timeout)
    side = {label: [s for s in streams if s.gateway == label] for label in ("survivor", "killed")}
    plain = _plain(gateways[0], side["survivor"], args, "kill")
    after = _workers(address)
    pids_after = {n: w.get("pid") for n, w in after.items()}
    return {"surviving_gateway": _summary(side["survivor"], plain),
            "killed_gateway": {**_summary(side["killed"], None), "kill": _at(side["killed"], killed_at,
                                                                           args.max_tokens)},
            "kill": _at(streams, killed_at, args.max_tokens),
            "worker_pids_before": pids_before, "worker_pids_after": pids_after,
            "worker_pids_unchanged": pids_before == pids_after,
            "workers_healthy_after": all(w["healthy"] for w in after.values()),
            "worker_sequences_after": {n: w.get("sequences") for n, w in after.items()}}


def _start_head(logs: Path, report: dict) -> tuple[subprocess.Popen, str]:
    """A Ray head of our own on loopback, in a short temp dir of its own (Ray's AF_UNIX socket paths under it must stay
    within 107 bytes), with no 30 s drain when it is stopped: the pools and the gateways go with it."""
    report["ray_temp_dir"] = tempfile.mkdtemp(prefix="chaos-ray-")
    return start_ray_head(report["ray_temp_dir"], lambda address: ray_env(address) | {
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}, log=logs / "ray-head.log")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    add = parser.add_argument
    add("--scenarios", nargs="+", choices=["scale", "gateway_kill"], default=["scale", "gateway_kill"],
        help="the scenarios to run, in order")
    add("--sessions", type=int, default=16, help="concurrent greedy streams")
    add("--max-tokens", type=int, default=64, help="tokens per stream")
    add("--threads", type=int, default=1, help="torch threads per worker")
    add("--target", default=DEFAULT_TARGET, help="target model")
    add("--draft", default=DEFAULT_DRAFT, help="draft model")
    add("--dtype", default="bfloat16", help="for `tandem pools start` (float32: exact identity with plain)")
    add("--pool-args", default="", help="more `tandem pools start` flags, one string")
    add("--scale-after", type=float, default=3.0, help="s after the first token")
    add("--scale-hold", type=float, default=5.0, help="s at two draft workers, at least")
    add("--kill-after", type=float, default=3.0, help="s after the first token")
    add("--stream-timeout", type=float, default=1800.0, help="each stream's deadline, s")
    add("--ray-address", default=None, help="join this cluster (default: start a head here)")
    add("--redis-url", default=None, help="the gateways' session store (default: a redis-server started here)")
    add("--log-dir", default=None, help="for the gateways' and the head's output (default: a tmp dir)")
    add_json_option(parser, "the report")
    args = parser.parse_args(argv)
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="tandem-chaos-"))
    logs.mkdir(parents=True, exist_ok=True)
    command = "python -m tandem.bench.pools_chaos " + shlex.join(sys.argv[1:] if argv is None else argv)
    report: dict = {"command": command,
                    "settings": {k: v for k, v in vars(args).items() if k != "json"}, "dtype_note": DTYPE_NOTE,
                    "logs": str(logs), "scenarios": {}}
    address, head, processes, ours, began = args.ray_address, None, [], False, time.monotonic()
    # One session store for all the gateways, as in a deployment (and a SIGKILLed gateway would leave an embedded
    # redis-server of its own running).
    redis = None if args.redis_url else EmbeddedRedis()
    try:
        if address is None:
            head, address = _start_head(logs, report)
        run_tandem(address, "pools", "start", "--name", POOLS, "--target", args.target, "--draft", args.draft,
                   "--dtype", args.dtype, "--threads", str(args.threads), "--draft-workers", "1", "--target-replicas",
                   "1", *shlex.split(args.pool_args), timeout=1800)  # long: a first run pulls the registry models
        ours = True  # from here on the pools are this run's to stop
        count = 2 if "gateway_kill" in args.scenarios else 1
        with ThreadPoolExecutor(count) as pool:  # side by side: each takes seconds to import and attach
            url = args.redis_url or redis.start().url
            started = list(pool.map(lambda i: start_gateway(address, POOLS, ["--redis-url", url],
                                                            logs / f"gateway-{i}.log", processes), range(count)))
        gateways = [gateway.address for gateway in started]
        prompts = (load_set("chat") * args.sessions)[: args.sessions]
        report["setup_s"] = round(time.monotonic() - began, 3)  # head, pools and gateways started
        for name in args.scenarios:
            began = time.monotonic()
            known = report["scenarios"].get("scale", {}).get("worker_pids_after")  # the pids the kill starts from
            report["scenarios"][name] = (scale(address, gateways, prompts, args) if name == "scale" else
                                         gateway_kill(address, gateways, prompts, args, started[1].process, known))
            report["scenarios"][name]["scenario_s"] = round(time.monotonic() - began, 3)  # the CLI calls included
            print(json.dumps({name: report["scenarios"][name]}), file=sys.stderr, flush=True)
    finally:
        for process in processes:  # all signalled first: each gateway's shutdown takes a while
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:  # still draining: the cleanup must not leave it (or the head) running
                process.kill()
                process.wait()
        if head is not None:
            head.terminate()
            head.wait(timeout=120)
        elif ours:
            subprocess.run([str(BIN / "tandem"), "pools", "stop", "--name", POOLS], env=ray_env(address),
                           capture_output=True, timeout=120)
        if redis is not None:
            redis.stop()
    if wants_text(args):
        print(json.dumps(report, indent=2))
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
