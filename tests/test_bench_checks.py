"""The benchmarks' command lines: a bad flag value is refused before any work (a request, a model load, Ray) in one
line that names the flag, exit status 2; the Ray benchmarks start a Ray of their own on loopback, never join one the
machine runs; with the JSON on stdout, stdout holds the JSON alone."""

from __future__ import annotations

import json

import pytest
import ray

from tandem.bench import decode_steps, detok, forward_ab, pool_overhead, serving, turns


class Started(Exception):
    """The benchmark got past its checks to its work (a request, Ray), which a test stands in for."""


def _started(*args, **kwargs):
    raise Started


def _refusal(main, argv: list[str], capsys) -> str:
    """main(argv)'s one line on stderr; it must exit with status 2 before starting anything."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip()


@pytest.mark.parametrize(("argv", "message"), [
    (["--concurrency", "1", "0"], "--concurrency: must be at least 1, got 0"),  # waited forever for a slot
    (["--concurrency", "-2"], "--concurrency: must be at least 1, got -2"),
    (["--repeat", "0"], "--repeat: must be at least 1, got 0"),
    (["--max-tokens", "0"], "--max-tokens: must be at least 1, got 0"),
    (["--threads", "0"], "--threads: must be at least 1, got 0"),
])
def test_serving_refuses_bad_values_before_any_request(monkeypatch, capsys, argv: list[str], message: str) -> None:
    monkeypatch.setattr(serving, "run", _started)
    assert _refusal(serving.main, ["--address", "127.0.0.1:9", *argv], capsys) == f"error: {message}"


@pytest.mark.parametrize(("argv", "message"), [
    (["--num-prompts", "-1"], "--num-prompts: must be at least 1, got -1"),  # ran all prompts but the last
    (["--num-prompts", "0"], "--num-prompts: must be at least 1, got 0"),
    (["--max-tokens", "0"], "--max-tokens: must be at least 1, got 0"),
])
def test_turns_refuses_bad_values_before_any_request(monkeypatch, capsys, argv: list[str], message: str) -> None:
    monkeypatch.setattr(turns, "run", _started)
    assert _refusal(turns.main, ["--address", "127.0.0.1:9", *argv], capsys) == f"error: {message}"


@pytest.mark.parametrize(("argv", "message"), [
    (["--tokens", "1023"], "--tokens: must be at least 1024 (the report's 1024-token windows), got 1023"),
    (["--tokens", "0"], "--tokens: must be at least 1024 (the report's 1024-token windows), got 0"),
    (["--repeats", "0"], "--repeats: must be at least 1, got 0"),
])
def test_detok_refuses_fewer_tokens_than_its_windows(capsys, argv: list[str], message: str) -> None:
    assert _refusal(detok.main, argv, capsys) == f"error: {message}"


@pytest.mark.parametrize(("argv", "message"), [
    (["--steps", "1"], "--steps: must be at least 2, got 1"),
    (["--repeats", "0"], "--repeats: must be at least 1, got 0"),
    (["--tokens", "0"], "--tokens: must be at least 1, got 0"),
])
def test_decode_steps_refuses_bad_values_before_loading_its_model(capsys, argv: list[str], message: str) -> None:
    assert _refusal(decode_steps.main, argv, capsys) == f"error: {message}"


def test_detok_runs_at_one_window(capsys) -> None:
    """The least --tokens it takes: the first and the last window are the whole output."""
    detok.main(["--tokens", str(detok.WINDOW), "--repeats", "1", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert all(row["tokens"] == detok.WINDOW and row["new"]["us_per_token_first_1k"] > 0
               for row in report["results"])


@pytest.mark.parametrize(("argv", "message"), [
    (["--calls", "0"], "--calls: must be at least 1, got 0"),
    (["--blocks", "-1"], "--blocks: must be at least 1, got -1"),
    (["--calls", "1", "--blocks", "1"],
     "--calls: with --blocks 1, must be at least 2 (the p90 needs 2 calls a method), got 1"),
])
def test_pool_overhead_refuses_bad_values_before_ray_starts(monkeypatch, capsys, argv: list[str],
                                                            message: str) -> None:
    monkeypatch.setattr(ray, "init", _started)
    assert _refusal(pool_overhead.main, argv, capsys) == f"error: {message}"


class _RayInit:
    """ray.init's arguments, recorded; then Started, so no Ray runs."""

    def __init__(self) -> None:
        self.kwargs: dict = {}

    def __call__(self, *args, **kwargs):
        self.kwargs = kwargs | {"args": args}
        raise Started


def _own_loopback_cluster(kwargs: dict) -> bool:
    """ray.init's arguments start a new local cluster on loopback (without an address, ray.init joins RAY_ADDRESS or
    the cluster `ray start` runs on this machine, which refuses num_cpus)."""
    return kwargs.get("address") == "local" and kwargs.get("_node_ip_address") == "127.0.0.1" and not kwargs["args"]


def test_pool_overhead_starts_a_ray_of_its_own_on_loopback(monkeypatch) -> None:
    init = _RayInit()
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(Started):
        pool_overhead.main(["--calls", "2", "--blocks", "1"])
    assert _own_loopback_cluster(init.kwargs), init.kwargs


def test_decode_steps_ray_starts_a_ray_of_its_own_on_loopback(monkeypatch) -> None:
    init = _RayInit()
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(Started):
        decode_steps._engines(None, 2, ray_replica=True, threads=1)
    assert _own_loopback_cluster(init.kwargs), init.kwargs
    assert init.kwargs["num_cpus"] == 1


def test_forward_ab_json_on_stdout_is_all_stdout_holds(tiny_dirs, capsys) -> None:
    code = forward_ab.main(["--compare", "fusion", "--target", str(tiny_dirs.target), "--draft", str(tiny_dirs.draft),
                            "--dtype", "float32", "--widths", "1", "--steps", "2", "--context", "8", "--json"])
    out, err = capsys.readouterr()
    assert code == 0
    (line,) = out.splitlines()
    report = json.loads(line)
    assert set(report) == {"config", "target", "draft"}
    assert f"{tiny_dirs.target} width 1: fused" in err  # the progress lines, on stderr
