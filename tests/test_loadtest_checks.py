"""python -m loadtest's checks before a run (flags JSON cannot hold, an --out no run could write to, a sweep's levels
and repeats), its wait for a server still loading its models, and Ctrl-C: a line on stderr, status 130, and the
requests measured so far written."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway_harness import ServerThread, tiny_backend
from loadtest.__main__ import main
from loadtest.config import RunConfig

ROOT = Path(__file__).resolve().parent.parent
NOBODY = "127.0.0.1:9"  # the discard port: nothing answers there
# Flags that reach a server: with the checks missing, the run fails to connect at once (status 1) instead.
UNREACHABLE = ["--address", NOBODY, "--requests", "1", "--connect-timeout", "0.5"]
SWEEP = ["sweep", *UNREACHABLE, "--no-plots"]


def _usage_error(argv: list[str], capsys) -> str:
    """main(argv)'s stderr, one line; its exit status must be 2."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1, err
    return err.strip()


# --- seconds JSON can hold ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["duration", "grace", "timeout", "connect_timeout"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_seconds_must_be_finite(field: str, value: float) -> None:
    """results.json and trace.jsonl are strict JSON: an infinite duration failed when the run was written."""
    with pytest.raises(ValueError, match=rf"^{field}: must be"):
        RunConfig(address=NOBODY, requests=1, **{field: value})
    assert RunConfig(address=NOBODY, requests=1, rate=math.inf).to_json()["rate"] == "inf"  # rate may be inf


@pytest.mark.parametrize("flag", ["--duration", "--grace", "--timeout"])
def test_an_infinite_seconds_flag_is_a_usage_error(flag: str, tmp_path, capsys) -> None:
    err = _usage_error([*UNREACHABLE, flag, "inf", "--out", str(tmp_path / "out")], capsys)
    assert err.startswith(f"error: {flag}: must be ") and err.endswith(", got inf")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_a_temperature_no_sampler_takes_is_a_usage_error(value: str, tmp_path, capsys) -> None:
    """An infinite temperature went to the server and failed the run at its warm-up."""
    err = _usage_error([*UNREACHABLE, "--temperature", value, "--out", str(tmp_path / "out")], capsys)
    assert err == f"error: --temperature: must be a finite number, not negative, got {float(value)!r}"


# --- --out --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [[], ["sweep", "--rates", "1"]])
def test_an_out_no_run_could_write_to_is_refused_before_the_run(command: list[str], tmp_path, capsys) -> None:
    file = tmp_path / "file"
    file.write_text("")
    err = _usage_error([*command, *UNREACHABLE, "--out", str(file)], capsys)
    assert err == f"error: --out: cannot write into {file}: it is a file, not a directory"
    err = _usage_error([*command, *UNREACHABLE, "--out", str(file / "run")], capsys)
    assert err == f"error: --out: cannot write into {file / 'run'}: Not a directory"


# --- a sweep's levels and repeats ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "message"), [
    (["--rates", "2", "2"], "--rates: each level once, got rate=2 twice"),
    (["--rates", "1", "2", "2.0000001"], "--rates: each level once, got rate=2 twice"),  # one label, one directory
    (["--rates", "inf", "inf"], "--rates: each level once, got rate=inf twice"),
    (["--concurrencies", "3", "1", "3"], "--concurrencies: each level once, got concurrency=3 twice"),
    (["--concurrencies", "0"], "--concurrencies: must be at least 1, got 0"),
    (["--concurrencies", "2", "-1"], "--concurrencies: must be at least 1, got -1"),
    (["--rates", "1", "--repeats", "0"], "--repeats: must be at least 1, got 0"),
])
def test_sweep_levels_and_repeats_are_checked_before_any_run(argv: list[str], message: str, tmp_path,
                                                            capsys) -> None:
    assert _usage_error([*SWEEP, *argv, "--out", str(tmp_path / "sweep")], capsys) == f"error: {message}"
    assert not (tmp_path / "sweep").exists()


# --- against a real gateway ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_waits_for_a_server_still_loading_up_to_the_connect_timeout(backend: str, tiny_models, tmp_path,
                                                                    capsys) -> None:
    """A gateway answers on its port at once and turns ready once its models have loaded (grpc.health.v1, HTTP 503
    until then); it refuses requests meanwhile, which failed the warm-up of `tandem serve ... & python -m loadtest`."""
    target, draft, _ = tiny_models
    load, loaded = tiny_backend(target, draft), threading.Event()

    def slow_load():
        loaded.wait(60)
        return load()

    server = ServerThread(slow_load, wait_ready=False, http_port=0)
    try:
        where = ["--address", server.address] if backend == "grpc" else \
            ["--backend", "openai", "--url", server.gateway.http_url]
        argv = [*where, "--requests", "2", "--max-tokens", "4", "--lengths", "short"]
        assert main([*argv, "--connect-timeout", "0.5", "--out", str(tmp_path / "early")]) == 1
        assert capsys.readouterr().err == (
            f"error: --address: the server at {server.address} answered but was not ready within 0.5 s (readiness "
            f"NOT_SERVING)\n" if backend == "grpc" else
            f"error: --url: the server at {server.gateway.http_url} answered but was not ready within 0.5 s (not "
            f"ready: the engine is still loading)\n")
        threading.Timer(1.0, loaded.set).start()
        assert main([*argv, "--connect-timeout", "60", "--out", str(tmp_path / "run")]) == 0
        assert json.loads((tmp_path / "run" / "results.json").read_text())["completed"] == 2
    finally:
        loaded.set()
        server.stop()


# `python -m loadtest` with Ctrl-C raising KeyboardInterrupt, as at a terminal: a test run in the background may have
# SIGINT ignored, and a child inherits that.
LOADTEST_AT_A_TERMINAL = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                          "runpy.run_module('loadtest', run_name='__main__', alter_sys=True)")


def _interrupt(argv: list[str], server: ServerThread, under_way: Callable[[], bool]) -> None:
    """Run `python -m loadtest ARGV` against `server`, Ctrl-C it once `under_way()`, and check how it ends: status
    130, "interrupted" its last line, no traceback. The server is stopped afterwards."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-c", LOADTEST_AT_A_TERMINAL, *argv], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.wait_for(under_way, timeout=120), "the run did not get under way"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert server.wait_for(server.caches_empty), "the interrupted requests were not cancelled on the wire"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        server.stop()
    assert proc.returncode == 130 and err.splitlines()[-1:] == ["interrupted"] and "Traceback" not in err, err


def test_ctrl_c_writes_the_requests_so_far_and_exits_130(tiny_models, tmp_path) -> None:
    target, draft, _ = tiny_models
    server = ServerThread(tiny_backend(target, draft))
    out, requests = tmp_path / "run", 64
    _interrupt(["--address", server.address, "--rate", "inf", "--requests", str(requests), "--max-tokens", "512",
                "--ignore-eos", "--warmup", "0", "--lengths", "short", "--out", str(out)], server,
               lambda: len(server.engine.sequences) > 0)
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["interrupted"] is True and results["requests"] == requests
    assert results["cancelled"] > 0 and results["completed"] + results["failed"] + results["not_sent"] == requests
    assert len((out / "trace.jsonl").read_text().splitlines()) == 1 + requests - results["not_sent"]


def test_ctrl_c_in_a_sweep_writes_a_sweep_json_of_the_runs_finished(tiny_models, tmp_path) -> None:
    """An interrupted sweep kept its finished levels' directories but wrote no sweep.json to read them by."""
    target, draft, _ = tiny_models
    server = ServerThread(tiny_backend(target, draft))
    out = tmp_path / "sweep"
    # Ctrl-C once the first run has ended: the second takes as long as the first, so it is under way.
    _interrupt(["sweep", "--address", server.address, "--concurrencies", "1", "--modes", "off", "auto", "--requests",
                "4", "--max-tokens", "256", "--ignore-eos", "--warmup", "0", "--lengths", "short", "--no-plots",
                "--out", str(out)], server, lambda: any(out.glob("*/results.json")))
    sweep = json.loads((out / "sweep.json").read_text())
    assert [run["speculation"] for run in sweep["runs"]] == ["off"], sweep
    assert sweep["interrupted_in"] == "concurrency1-auto"
    assert sweep["runs"][0]["results"]["completed"] == 4 and sweep["ratios"] == []


@pytest.mark.parametrize("command", ["plot", "bound", "report", "rebuild"])
def test_each_sweep_file_command_has_its_own_help(command: str, capsys) -> None:
    """bound, report and rebuild printed plot's usage and took its --out, which they ignored."""
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert exited.value.code == 0 and out.startswith(f"usage: python -m loadtest {command} ")
    assert ("--out" in out) == (command == "plot")
