"""tandem.bench.pools_chaos end to end on tiny models: its own Ray head, pools, gateways, both scenarios, in float32
(where greedy speculative output must equal plain decoding exactly)."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("ray")

from tandem.bench import pools_chaos

BIN = Path(sys.executable).parent
SESSIONS = 4
# Long enough (a second or two of streaming here) that a kill 0.1 s after the first token surely lands mid-stream. The
# scale steps take longer than that to run (`tandem pools scale` alone starts in seconds): on tiny models they land
# after these streams end unless the streams are far longer (and the test minutes long); see the reported events.
TOKENS = 128


@pytest.fixture
def short_tmp(monkeypatch):
    """The script's mkdtemp (the Ray head's temp dir) under a short dir this test removes afterwards."""
    root = tempfile.mkdtemp(prefix="tc-")
    monkeypatch.setattr(tempfile, "tempdir", root)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_scale_and_gateway_kill_fail_nothing_and_keep_greedy_output(tiny_dirs, tmp_path, short_tmp) -> None:
    if shutil.which("ray", path=str(BIN)) is None:
        pytest.skip("no ray command")
    out = tmp_path / "chaos.json"
    report = pools_chaos.main([
        "--target", str(tiny_dirs.target), "--draft", str(tiny_dirs.draft), "--dtype", "float32",
        "--sessions", str(SESSIONS), "--max-tokens", str(TOKENS), "--scale-after", "0.1", "--scale-hold", "2.5",
        "--kill-after", "0.1", "--pool-args", "--fixed-k 4",  # fixed k: every round drafts, so the draft pool is used
        "--stream-timeout", "120", "--log-dir", str(tmp_path / "logs"), "--json", str(out)])
    assert json.loads(out.read_text()) == report
    assert report["ray_temp_dir"].startswith(short_tmp)
    assert report["settings"]["dtype"] == "float32" and "bfloat16" in report["dtype_note"]

    scale = report["scenarios"]["scale"]
    assert scale["failed"] == 0 and scale["completed"] == SESSIONS, scale["errors"]
    assert scale["identical_to_plain"] == SESSIONS
    assert scale["tokens"] == SESSIONS * TOKENS and scale["drafted_tokens"] > 0
    assert sorted(scale["worker_pids_after"]) == ["draft-0", "target-0"]  # draft-1 came and went
    events = scale["events"]
    assert 0 < events["scale_up"]["t_s"] < events["scale_up_done"]["t_s"] < events["scale_down_done"]["t_s"]
    assert events["scale_up"]["streams_running"] > 0  # issued mid-load

    kill = report["scenarios"]["gateway_kill"]
    survivor, killed = kill["surviving_gateway"], kill["killed_gateway"]
    assert survivor["streams"] == killed["streams"] == SESSIONS // 2
    assert survivor["completed"] == survivor["streams"] and survivor["failed"] == 0, survivor["errors"]
    assert survivor["identical_to_plain"] == survivor["streams"]
    assert killed["completed"] < killed["streams"] and killed["kill"]["streams_running"] > 0
    assert all(s["outcome"] == "failed" and s["error"] for s in killed["per_stream"] if s["tokens"] < TOKENS)
    assert kill["worker_pids_unchanged"] and kill["workers_healthy_after"]
    assert sorted(kill["worker_pids_before"]) == ["draft-0", "target-0"]
