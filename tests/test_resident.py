"""tandem.bench.resident: a benchmark worker loaded once and asked one run at a time over its pipes, driven here
with vllm_compare's real tandem side on the tiny models."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tandem.bench.resident import Resident
from tandem.bench.vllm_compare_workers import TANDEM_SIDE

SERVICES = str(Path(__file__).resolve().parents[1] / "services")


def tandem_job(tiny_dirs, **changes) -> dict:
    return {"target": str(tiny_dirs.target), "draft": str(tiny_dirs.draft), "texts": ["hello there", "count to 3"],
            "max_tokens": 8, "threads": 1, "dtype": "float32", "compile": False, "draft_quantization": "none"} | changes


def env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [SERVICES, os.environ.get("PYTHONPATH")]))}


def test_the_tandem_side_loads_once_and_answers_runs_in_turn(tiny_dirs, tmp_path: Path) -> None:
    seen: list[str] = []
    with Resident("tandem", TANDEM_SIDE, tandem_job(tiny_dirs), tmp_path / "w.log", env(), echo=("tandem ",),
                  say=seen.append) as worker:
        assert worker.loaded["torch_threads"] == 1 and worker.loaded["load_seconds"] >= 0
        assert worker.loaded["draft_ids_scored"] > 40  # the whole vocabulary by default
        plain = worker.ask({"mode": "plain_b1", "prompts": [1]})
        auto = worker.ask({"mode": "auto_b1", "prompts": [1]})
        both = worker.ask({"mode": "plain_b2", "prompts": [0, 1]})
    assert plain["requests"] == 1 and plain["tokens"] == len(plain["outputs"][0]) == 8
    assert auto["outputs"] == plain["outputs"] and "drafted" in auto and "accepted" in auto  # greedy float32
    assert both["requests"] == 2 and both["outputs"][1] == plain["outputs"][0]
    assert any("tandem plain_b1 1: 8 tokens" in line for line in seen)
    assert "==== tandem" in (tmp_path / "w.log").read_text()


def test_the_tandem_side_drafts_from_the_first_ids_alone_when_asked(tiny_dirs, tmp_path: Path) -> None:
    """`--draft-vocab 40`: the AUTO engine's drafter scores ids below 40 alone; its output stays plain greedy's."""
    with Resident("tandem", TANDEM_SIDE, tandem_job(tiny_dirs, draft_vocab=40), tmp_path / "w.log", env(),
                  echo=("tandem ",)) as worker:
        plain = worker.ask({"mode": "plain_b1", "prompts": [1]})
        auto = worker.ask({"mode": "auto_b1", "prompts": [1]})
    assert worker.loaded["draft_ids_scored"] == 40
    assert auto["outputs"] == plain["outputs"]


def test_a_worker_that_dies_is_reported_with_the_end_of_its_output(tiny_dirs, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"(?s)tandem exited 1:.*ModelNotFound: model .*absent"):
        Resident("tandem", TANDEM_SIDE, tandem_job(tiny_dirs, target=str(tmp_path / "absent")), tmp_path / "w.log",
                 env())
    script = tmp_path / "once.py"  # answers one request, then exits
    script.write_text("import json, os, sys\nout = os.fdopen(int(sys.argv[2]), 'w')\nout.write('{}\\n'); out.flush()\n"
                      "sys.stdin.readline(); out.write('{\"ok\": 1}\\n'); out.flush(); print('bye'); sys.exit(3)\n")
    with Resident("once", [sys.executable, str(script)], {}, tmp_path / "w.log") as worker:
        assert worker.ask({}) == {"ok": 1}
        with pytest.raises(RuntimeError, match="once exited 3:\nbye"):
            worker.ask({})


def test_a_worker_under_another_python_serves_with_the_file_loaded_by_path(tmp_path: Path) -> None:
    resident = Path(__file__).resolve().parents[1] / "services" / "tandem" / "bench" / "resident.py"
    script = tmp_path / "echo.py"  # tandem not importable: only the file, as vLLM's side loads it
    script.write_text(
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('r', {str(resident)!r})\n"
        "r = importlib.util.module_from_spec(spec); spec.loader.exec_module(r)\n"
        "r.serve(lambda job: ({'job': job}, lambda req: {'twice': 2 * req['n']}))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with Resident("echo", [sys.executable, "-I", str(script)], {"a": 1}, tmp_path / "w.log", env) as worker:
        assert worker.loaded == {"job": {"a": 1}}
        assert [worker.ask({"n": n}) for n in (1, 5)] == [{"twice": 2}, {"twice": 10}]
