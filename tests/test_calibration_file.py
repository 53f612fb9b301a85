"""`tandem serve --calibration-file`: measured costs kept across restarts, reused only for the same setup."""

from __future__ import annotations

import json
import logging
import os

from tandem.core import bf16_linear
from tandem.core.config import EngineConfig, SpecConfig
from tandem.engines import Arm, BuildOptions, ClusterOptions, LocalOptions, build
from tandem.engines import calibration_file as stored

CALIBRATED = "calibrated in"  # core.calibration's log line: calibration ran
REUSING = "calibration: reusing"


def _options(tiny_dirs, path, max_batch: int = 2, placement=None, draft: bool = True, **spec) -> BuildOptions:
    config = EngineConfig(spec=SpecConfig(k_max=3, k_init=2, **spec), max_batch=max_batch)
    return BuildOptions(str(tiny_dirs.target), (Arm("", str(tiny_dirs.draft) if draft else "", config),),
                        placement or LocalOptions(threads=1, dtype="float32"), calibration_file=str(path))


def _build(options: BuildOptions, caplog) -> tuple[object, str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tandem"):
        engine = build(options)[""].engine
    return engine, caplog.text


def test_a_restart_reuses_the_stored_costs_and_a_changed_setup_calibrates(tiny_dirs, tmp_path, caplog) -> None:
    path = tmp_path / "costs" / "calibration.json"
    first, log = _build(_options(tiny_dirs, path), caplog)
    assert CALIBRATED in log and first.costs.calibrated
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 1 and entries[0]["costs"] == first.costs.to_dict()

    again, log = _build(_options(tiny_dirs, path), caplog)
    assert REUSING in log and CALIBRATED not in log
    assert again.costs.to_dict() == first.costs.to_dict() and again.costs.calibrated
    assert again.costs.layout == again.verifier.row_layout  # priced as this engine's target lays out rows

    wider, log = _build(_options(tiny_dirs, path, max_batch=4), caplog)
    assert CALIBRATED in log and "engine.max_batch" in log and (4, 1) in wider.costs.batched
    assert len(json.loads(path.read_text())["entries"]) == 2
    _, log = _build(_options(tiny_dirs, path, max_batch=4), caplog)
    assert REUSING in log and CALIBRATED not in log


def test_a_target_alone_keeps_its_costs_where_it_looks_up_drafts_for_batches(tiny_dirs, tmp_path, caplog) -> None:
    """With no draft model, the costs steer only prompt lookup's blocks in batches: an engine that looks up drafts
    for batches times its target's forwards and keeps them; one stream, or no lookup, calibrates nothing."""
    path = tmp_path / "calibration.json"
    first, log = _build(_options(tiny_dirs, path, draft=False, prompt_lookup=True), caplog)
    assert CALIBRATED in log and (2, 3) in first.costs.batched and not first.costs.draft_step
    again, log = _build(_options(tiny_dirs, path, draft=False, prompt_lookup=True), caplog)
    assert REUSING in log and again.costs.to_dict() == first.costs.to_dict()
    for options in (_options(tiny_dirs, tmp_path / "one.json", max_batch=1, draft=False, prompt_lookup=True),
                    _options(tiny_dirs, tmp_path / "none.json", draft=False)):
        engine, log = _build(options, caplog)
        assert CALIBRATED not in log and not engine.costs.batched and not os.path.exists(options.calibration_file)


def test_a_fixed_k_keeps_nothing_and_a_damaged_file_is_rewritten(tiny_dirs, tmp_path, caplog) -> None:
    path = tmp_path / "calibration.json"
    _, log = _build(_options(tiny_dirs, path, adaptive=False), caplog)
    assert CALIBRATED not in log and not path.exists()  # a fixed k never calibrates: nothing to keep

    path.write_text('{"format": 1, "entries": [')
    _, log = _build(_options(tiny_dirs, path), caplog)
    assert "ignoring" in log and CALIBRATED in log
    assert len(json.loads(path.read_text())["entries"]) == 1


def test_the_key_follows_the_models_files_workers_and_options(tiny_dirs, tmp_path) -> None:
    from tandem.hostinfo import host_facts

    kernel = bf16_linear.ready()  # loaded before the host is read, as a model's load loads it
    options = _options(tiny_dirs, tmp_path / "c.json")
    arm = options.arms[0]
    here = [{"host": host_facts(), "threads": None}]
    key = stored.key(options, arm, here)
    assert key == stored.key(options, arm, here) and key["workers"][0]["host"]["cores"] == len(os.sched_getaffinity(0))
    if kernel:  # costs taken on one path of the bf16 kernel are not another's
        assert key["workers"][0]["host"]["cpu_linear_path"] == bf16_linear.PATH_NAMES[bf16_linear.isa_bits()]
    assert key["versions"]["tandem_code"] and key["target_identity"].startswith("files:")
    assert stored.key(options, arm, [{**here[0], "threads": 2}]) != key
    config = tiny_dirs.draft / "config.json"
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 1))
    assert stored.key(options, arm, here)["draft_identity"] != key["draft_identity"]
    threads = _options(tiny_dirs, tmp_path / "c.json", placement=LocalOptions(threads=2, dtype="float32"))
    assert stored.key(threads, threads.arms[0], here)["placement"]["threads"] == 2
    secret = BuildOptions(options.target, options.arms, ClusterOptions(ray_token_file="/secret/token"))
    assert "ray_token_file" not in stored.key(secret, arm, here)["placement"]


def test_serve_refuses_a_directory_as_its_calibration_file(tiny_dirs, tmp_path, capsys) -> None:
    from tandem.cli.main import main

    code = main(["serve", "--in-process", "--target", str(tiny_dirs.target), "--draft", str(tiny_dirs.draft),
                 "--calibration-file", str(tmp_path)])
    assert code == 2 and f"--calibration-file: {tmp_path} is a directory" in capsys.readouterr().err


def test_serve_keeps_costs_under_tandem_home_unless_told_otherwise(tmp_path, monkeypatch) -> None:
    from tandem.cli.main import build_parser
    from tandem.cli.serve import build_options
    from tandem.models.store import CALIBRATION_ENV

    def kept_in(*flags: str) -> str:
        args = build_parser().parse_args(["serve", "--in-process", *flags])
        return build_options(args, EngineConfig(), None).calibration_file

    monkeypatch.delenv(CALIBRATION_ENV)
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    assert kept_in() == str(tmp_path / "home" / "calibration.json")
    assert kept_in("--calibration-file", str(tmp_path / "c.json")) == str(tmp_path / "c.json")
    assert kept_in("--calibration-file", "") == ""  # calibrate at every start
    monkeypatch.setenv(CALIBRATION_ENV, str(tmp_path / "env.json"))
    assert kept_in() == str(tmp_path / "env.json")
    monkeypatch.setenv(CALIBRATION_ENV, "")
    assert kept_in() == ""


def test_a_file_that_cannot_be_written_costs_a_warning_not_the_start(tiny_dirs, tmp_path, caplog) -> None:
    """The calibration ran and its costs serve; only the next start calibrates again."""
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    engine, log = _build(_options(tiny_dirs, blocked / "calibration.json"), caplog)
    assert CALIBRATED in log and engine.costs.calibrated
    assert f"could not store the costs in {blocked / 'calibration.json'}" in log


def test_tandem_serve_on_its_own_ray_gives_workers_every_core_and_a_restart_reuses_the_costs(tiny_dirs,
                                                                                               tmp_path) -> None:
    """`tandem serve` starts its local Ray before building the pools (engines.cluster.start_ray); that Ray is its own,
    so each worker gets every core (engines.cluster.worker_threads). Taken for a joined one, the workers ran Ray's
    one thread. With no --calibration-file it keeps its costs in its default file (here $TANDEM_CALIBRATION_FILE's;
    calibration.json under $TANDEM_HOME without it). The file's key holds what the workers report, and a second
    start with the same flags finds it: it reuses the costs and leaves the file as it was (calibrating again would
    store a new entry)."""
    from tandem.bench.local_cluster import serve_process

    path = tmp_path / "calibration.json"
    flags = ["--target", str(tiny_dirs.target), "--draft", str(tiny_dirs.draft), "--dtype", "float32",
             "--max-batch", "2"]
    with serve_process(flags, tmp_path / "serve.err", timeout_s=600, costs_file=str(path)):
        pass
    stored = path.read_text()
    entry, = json.loads(stored)["entries"]
    cores = len(os.sched_getaffinity(0))
    assert [worker["threads"] for worker in entry["key"]["workers"]] == [cores]
    written = path.stat().st_mtime_ns
    with serve_process(flags, tmp_path / "again.err", timeout_s=600, costs_file=str(path)):
        pass
    assert path.read_text() == stored and path.stat().st_mtime_ns == written


def test_the_key_follows_the_kernel_settings(tiny_dirs, tmp_path, monkeypatch) -> None:
    """Costs measured on oneDNN's bf16 products or sdpa are not those of tandem's kernels (core.bf16_linear,
    core.cpu_attention): the settings that choose them are part of the key."""
    options = _options(tiny_dirs, tmp_path / "c.json")
    here = [{"host": {"cores": 2}, "threads": None}]
    stored.versions.cache_clear()
    try:
        key = stored.key(options, options.arms[0], here)
        monkeypatch.setenv("TANDEM_CPU_LINEAR", "onednn")
        stored.versions.cache_clear()
        other = stored.key(options, options.arms[0], here)
        assert other != key and other["versions"]["kernel_settings"]["TANDEM_CPU_LINEAR"] == "onednn"
        assert other["versions"]["tandem_code"] == key["versions"]["tandem_code"]
    finally:
        stored.versions.cache_clear()
