"""loadtest.api_compare end to end on the tiny models (no guidellm: CI does not install it), and its pure parts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest

from loadtest import api_compare, api_compare_guidellm, api_compare_latency

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 8


def _compare(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "compare.json"
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-m", "loadtest.api_compare", "--json", str(out), "--dtype", "float32",
                           "--threads", "1", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return done, out


def _closed(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return False
    except OSError:
        return True


@pytest.mark.slow
def test_end_to_end_on_the_tiny_models(tiny_dirs, tmp_path) -> None:
    done, out = _compare(tmp_path, "--target", str(tiny_dirs.target), "--draft", str(tiny_dirs.draft),
                         "--max-tokens", str(MAX_TOKENS), "--concurrency", "1", "2", "--repeats", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[api_compare" in done.stderr and "parity bench-8" in done.stderr  # progress lines on stderr
    body = json.loads(out.read_text())
    assert {"command", "settings", "machine", "server", "parity", "latency", "targets", "seconds"} <= body.keys()
    assert body["machine"]["nproc"] >= 1 and body["machine"]["torch"]
    settings = body["settings"]
    assert settings["max_tokens"] == MAX_TOKENS and settings["concurrency"] == [1, 2] and settings["repeats"] == 1
    assert settings["openai_token_counts"] == "token_ids" and settings["guidellm"] is None
    assert "--in-process" in settings["serve_command"] and "--no-metrics" in settings["serve_command"]

    # parity: the 8 shipped prompts, greedy, the same text through the openai SDK and gRPC
    parity = body["parity"]
    assert (parity["equal"], parity["total"], parity["met"]) == (8, 8, True)
    assert [r["prompt"] for r in parity["prompts"]] == [f"bench-{i}" for i in range(1, 9)]
    for record in parity["prompts"]:
        assert record["equal"] and record["openai_chars"] == record["grpc_chars"]
        assert record["openai_completion_tokens"] == record["grpc_completion_tokens"] > 0
        assert record["openai_finish_reason"] == record["grpc_finish_reason"]

    levels = body["latency"]["levels"]
    assert [level["concurrency"] for level in levels] == [1, 2]
    for level in levels:
        assert level["requests"] == 8  # max(8, 2C)
        assert [(r["tool"], r["backend"], r["repeat"]) for r in level["runs"]] == [
            ("loadtest", "grpc", 1), ("loadtest", "openai", 1)]
        for backend in ("grpc", "openai"):
            pooled = level["pooled"][backend]
            assert pooled["completed"] == 8 and pooled["failed"] == 0, pooled["error_kinds"]
            # ignore_eos: every request max_tokens; the openai backend counts them exactly from return_token_ids
            assert pooled["total_output_tokens"] == 8 * MAX_TOKENS
            for key in ("ttft_p50", "ttft_p90", "itl_p50", "itl_p90", "request_itl_p50", "output_throughput"):
                assert pooled[key] > 0, (backend, key)
        ratios = level["openai_over_grpc"]
        assert set(ratios) == set(api_compare_latency.API_RATIOS) and all(v > 0 for v in ratios.values())
        assert len(level["openai_over_grpc_each"]) == 1
        assert set(level["api_met"]) == {"ttft_p50", "itl_p50"}
        assert all(isinstance(v, bool) for v in level["api_met"].values())
        assert "guidellm_vs_loadtest" not in level
    targets = body["targets"]
    assert targets["parity"] is True and "c2_openai_over_grpc_itl_p50" in targets and "all" in targets
    assert not any("guidellm" in key for key in targets)

    # the server is gone and its output kept
    assert Path(body["server"]["log"]).read_text().count("serving") >= 2
    http = urlparse(body["server"]["http"])
    host, port = body["server"]["grpc"].rsplit(":", 1)
    assert _closed(http.hostname, http.port) and _closed(host, int(port))


def test_a_server_that_fails_to_start_is_reported(tmp_path) -> None:
    done, out = _compare(tmp_path, "--target", str(tmp_path / "missing"), "--draft", str(tmp_path / "missing"),
                         "--ready-timeout", "120")
    assert done.returncode == 1
    body = json.loads(out.read_text())
    assert "the server exited" in body["error"] and "parity" not in body


def test_bad_arguments_exit_2(tmp_path) -> None:
    with pytest.raises(SystemExit) as exc:
        api_compare.parse_args(["--json", str(tmp_path / "x.json"), "--guidellm", str(tmp_path / "nope")])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        api_compare.parse_args(["--json", "x.json", "--concurrency", "0"])


def test_the_shipped_prompts_and_the_schedule() -> None:
    prompts = api_compare.bench_prompts()
    assert len(prompts) == 8 and all(p.kind == "chat" and len(p.messages) == 1 for p in prompts)
    assert [api_compare_latency.requests_for(c) for c in (1, 4, 8, 16)] == [8, 8, 16, 32]
    assert api_compare_latency.schedule_for(0, False) == ["grpc", "openai"]
    assert api_compare_latency.schedule_for(1, False) == ["openai", "grpc"]
    # guidellm always beside a loadtest openai run
    assert api_compare_latency.schedule_for(0, True) == ["grpc", "openai", "guidellm"]
    assert api_compare_latency.schedule_for(1, True) == ["guidellm", "openai", "grpc"]


def _guidellm_request(start: float, first: float, last: float, tokens: int) -> dict:
    return {"info": {"timings": {"request_start": start, "first_token_iteration": first,
                                 "last_token_iteration": last}},
            "output_metrics": {"text_tokens": tokens}}


def _stat(p50_ms: float, count: int) -> dict:
    return {"successful": {"count": count, "percentiles": {"p50": p50_ms}}}


def test_guidellm_reports_are_read_by_its_own_definitions_and_compared() -> None:
    report = {"benchmarks": [{
        "duration": 2.0,
        "requests": {"successful": [_guidellm_request(0.0, 0.1, 0.8, 8), _guidellm_request(1.0, 1.3, 1.6, 4)]},
        "metrics": {"time_to_first_token_ms": _stat(100.0, 2), "inter_token_latency_ms": _stat(100.0, 2),
                    "request_totals": {"successful": 2, "errored": 0, "incomplete": 0}},
    }]}
    run = api_compare_guidellm.read_guidellm(report)
    assert run["ttfts"] == pytest.approx([0.1, 0.3]) and run["itls"] == pytest.approx([0.1, 0.1])
    assert run["total_output_tokens"] == 12 and run["output_throughput"] == 6.0
    assert run["own_ttft_p50"] == 0.1 and run["completed"] == 2
    pooled = api_compare_guidellm.guidellm_figures([run, run])
    assert pooled["ttft_p50"] == pytest.approx(0.2) and pooled["output_throughput"] == 6.0
    loadtest = {"ttft_p50": 0.19, "request_itl_p50": 0.125, "itl_p50": 0.05, "output_throughput": 6.0}
    compared = api_compare_latency.tool_comparison(pooled, loadtest)
    assert compared["guidellm_over_loadtest"]["ttft_p50"] == pytest.approx(0.2 / 0.19)
    assert compared["met"] == {"ttft_p50": True, "itl_p50": False}  # 0.1 / 0.125 is 20% off


def test_the_openai_backend_counts_tokens_from_return_token_ids_by_default() -> None:
    """loadtest's openai backend: return_token_ids (vLLM's field) by default, logprobs or chunks when asked."""
    import asyncio

    from loadtest.backend_base import RequestSpec
    from loadtest.config import RunConfig
    from loadtest.openai_backend import OpenAIBackend, _tokens

    prompt = api_compare.bench_prompts()[0]
    request = RequestSpec(prompt=prompt, request_id="r", session_id="s", max_tokens=4, temperature=0.0, seed=None,
                          ignore_eos=True, speculation="auto", max_k=None)
    bodies = {}
    for mode in ("token_ids", "logprobs", "chunks"):
        config = RunConfig(address="", backend="openai", url="http://127.0.0.1:8000", requests=1,
                           **({} if mode == "token_ids" else {"openai_token_counts": mode}))
        backend = OpenAIBackend(config)
        path, bodies[mode] = backend.body(request)
        asyncio.run(backend.close())
        assert path == "/v1/chat/completions"
    assert bodies["token_ids"]["return_token_ids"] is True and "logprobs" not in bodies["token_ids"]
    assert bodies["logprobs"]["logprobs"] is True and "return_token_ids" not in bodies["logprobs"]
    assert "logprobs" not in bodies["chunks"] and "return_token_ids" not in bodies["chunks"]
    choice = {"delta": {"content": "ab"}, "token_ids": [5, 6, 7],
              "logprobs": {"content": [{"token": "a"}, {"token": "b"}]}}
    assert [_tokens(choice, mode) for mode in ("token_ids", "logprobs", "chunks")] == [3, 2, 1]
    assert _tokens({"delta": {"content": ""}, "token_ids": [9]}, "token_ids") == 1  # ids held back from the text
