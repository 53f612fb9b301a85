"""tandem.bench.vllm_compare's pure parts (schedule, arguments) and its report (pooling, ratios against the targets),
without vLLM."""

from __future__ import annotations

import sys

import pytest

from tandem.bench import vllm_compare as compare
from tandem.bench import vllm_compare_report as report
from tandem.bench import vllm_compare_workers as workers


def run(tok_s: float, tokens: int = 100) -> dict:
    return {"tokens": tokens, "seconds": tokens / tok_s, "tok_s": tok_s}


def test_each_phase_pairs_every_prompt_on_both_systems_and_who_goes_first_alternates() -> None:
    order = compare.schedule(2, 2, 8, ["tandem", "vllm"])
    assert [p for p, *_ in order] == ["plain"] * 20 + ["spec"] * 20  # one vLLM engine resident per phase
    first = [(s, m, i) for p, r, s, m, i in order if (p, r) == ("plain", 0)]
    assert first == [("tandem", "plain_b1", 0), ("vllm", "plain_b1", 0), ("vllm", "plain_b1", 1),
                     ("tandem", "plain_b1", 1), ("tandem", "plain_b8", None), ("vllm", "plain_b8", None),
                     ("tandem", "auto_b8@plain", None), ("tandem", "auto_b8@plain", None),
                     ("vllm", "plain_b8", None), ("tandem", "plain_b8", None)]
    second = [(s, m, i) for p, r, s, m, i in order if (p, r) == ("spec", 1)]
    assert second == [("tandem", "plain_b8@spec", None), ("vllm", "spec_b8", None), ("tandem", "auto_b8", None),
                      ("tandem", "auto_b8", None), ("vllm", "spec_b8", None), ("tandem", "plain_b8@spec", None),
                      ("vllm", "spec_b1", 0), ("tandem", "auto_b1", 0), ("tandem", "auto_b1", 1),
                      ("vllm", "spec_b1", 1)]  # at once first on odd repeats, tandem's two modes swapping ends
    for phase in ("plain", "spec"):  # each of tandem's modes at N runs beside each vLLM engine, as often as it does
        at_n = [(s, m) for p, _, s, m, i in order if p == phase and i is None]
        counts = {key: at_n.count(key) for key in at_n}
        assert list(counts.values()) == [4, 4, 4]
        assert {m.split("@")[0] for s, m in counts if s == "tandem"} == {"plain_b8", "auto_b8"}
    only = compare.schedule(1, 3, 4, ["tandem"])
    assert {s for _, _, s, _, _ in only} == {"tandem"} and len(only) == 2 * (3 + 4)
    swapped = compare.schedule(2, 2, 8, ["tandem", "vllm"], ("spec", "plain"))  # --spec-first
    assert [p for p, *_ in swapped] == ["spec"] * 20 + ["plain"] * 20
    assert swapped == order[20:] + order[:20]  # each phase's own order unchanged


def test_merge_pools_one_repeats_runs_and_sums_the_counters() -> None:
    a = {"tokens": 100, "seconds": 10.0, "tok_s": 10.0, "requests": 1, "outputs": [[1]], "loadavg_1m": 2.0,
         "rounds": 40, "spec_rounds": 30, "drafted": 90, "accepted": 60}
    b = a | {"tokens": 50, "seconds": 2.5, "outputs": [[2]], "loadavg_1m": 3.5, "drafted": 10, "accepted": 10}
    merged = report.merge([a, b])
    assert (merged["tokens"], merged["seconds"], merged["tok_s"], merged["requests"]) == (150, 12.5, 12.0, 2)
    assert merged["outputs"] == [[1], [2]] and merged["loadavg_1m_max"] == 3.5
    assert (merged["drafted"], merged["accepted"], merged["alpha"]) == (100, 70, 0.7)
    vllm_like = report.merge([{k: v for k, v in a.items() if k not in ("rounds", "drafted")}])
    assert "drafted" not in vllm_like and "alpha" not in vllm_like
    # vLLM's speculation reports its own counters (vllm:spec_decode_*, per request): summed as drafted and accepted.
    vllm = {k: v for k, v in a.items() if k not in ("rounds", "spec_rounds", "drafted", "accepted")}
    spec = [vllm | {"spec_counters": {"spec_decode_num_drafts": 7.0, "spec_decode_num_draft_tokens": draft,
                                      "spec_decode_num_accepted_tokens": accepted}}
            for draft, accepted in ((28.0, 28.0), (40.0, 22.0))]
    assert {k: report.merge(spec)[k] for k in ("drafted", "accepted", "alpha")} == {
        "drafted": 68, "accepted": 50, "alpha": 0.7353}


def test_within_is_each_systems_speculation_over_its_own_plain() -> None:
    summary = {"tandem": {m: report.pool([run(v)]) for m, v in
                          {"plain_b1": 5.0, "auto_b1": 9.0, "plain_b8": 40.0, "auto_b8@plain": 44.0}.items()},
               "vllm": {m: report.pool([run(v)]) for m, v in {"plain_b1": 6.0, "spec_b1": 9.0}.items()}}
    assert report.within(summary, 8) == {"tandem": {"auto_b1/plain_b1": 1.8, "auto_b8@plain/plain_b8": 1.1},
                                         "vllm": {"spec_b1/plain_b1": 1.5}}


def test_pool_is_tokens_over_seconds_with_each_repeat_listed() -> None:
    pooled = report.pool([run(10.0, 100), run(20.0, 100)])
    assert pooled["tokens"] == 200 and pooled["seconds"] == 15.0
    assert pooled["tok_s"] == pytest.approx(200 / 15, abs=1e-3)
    assert pooled["tok_s_each"] == [10.0, 20.0] and pooled["tok_s_mean"] == 15.0


def test_ratios_take_each_systems_best_mode_and_judge_the_targets() -> None:
    summary = {
        "tandem": {m: report.pool([run(v)]) for m, v in
                   {"plain_b1": 12.0, "auto_b1": 20.0, "plain_b8": 70.0, "auto_b8@plain": 78.0, "auto_b8": 80.0,
                    "plain_b8@spec": 71.0, "served_off_b8": 60.0, "served_auto_b8": 50.0}.items()},
        "vllm": {m: report.pool([run(v)]) for m, v in
                 {"plain_b1": 13.2, "spec_b1": 17.6, "plain_b8": 76.9, "spec_b8": 59.4}.items()},
    }
    out = report.ratios(summary, 8)
    assert out["plain_b1"]["ratio"] == pytest.approx(12 / 13.2, abs=1e-4) and out["plain_b1"]["met"] is True
    assert out["spec_b1"]["ratio"] == pytest.approx(20 / 17.6, abs=1e-4) and out["spec_b1"]["met"] is False
    # At 8 tandem's best is taken among the modes timed in the phase of vLLM's best (plain): not the faster AUTO
    # of the speculative phase.
    best = out["best_b8"]
    assert (best["tandem_mode"], best["vllm_mode"], best["met"]) == ("auto_b8@plain", "plain_b8", True)
    assert best["ratio"] == pytest.approx(78 / 76.9, abs=1e-4)
    summary["vllm"]["spec_b8"] = report.pool([run(90.0)])
    best = report.ratios(summary, 8)["best_b8"]
    assert (best["tandem_mode"], best["vllm_mode"], best["met"]) == ("auto_b8", "spec_b8", False)
    served = out["served_best_b8"]
    assert served["tandem_mode"] == "served_off_b8" and served["target"] is None and served["met"] is None
    assert [t for *_, t in report.targets(8)] == [0.9, 1.2, 1.0, None]
    assert report.same_phase("spec_b4") == ["auto_b4", "plain_b4@spec"]


def test_a_missing_system_leaves_the_ratio_open() -> None:
    out = report.ratios({"tandem": {"plain_b1": report.pool([run(12.0)])}, "vllm": {}}, 8)
    assert out["plain_b1"] == {"tandem_mode": "plain_b1", "vllm_mode": None, "ratio": None, "target": 0.9,
                               "met": None}
    assert out["spec_b1"]["tandem_mode"] is None


def test_agreement_counts_identical_outputs_and_the_common_prefix() -> None:
    assert report.agreement([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6, 7]]) == {"identical": "1/2",
                                                                               "mean_common_prefix": 2.0}


def test_arguments_defaults_and_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_PYTHON", raising=False)
    args = compare.parse_args([])
    assert (args.threads, args.max_tokens, args.batch, args.k, args.repeats) == (2, 128, 8, 4, 2)
    assert args.vllm_python == compare.DEFAULT_VLLM_PYTHON and args.systems == ["tandem", "vllm"]
    assert args.prompts == "bench" and args.num_prompts is None and not args.no_served and args.dtype == "bfloat16"
    assert args.json == compare.DEFAULT_REPORT and args.kv_space == 2 and args.draft_vocab == 0
    assert args.phases == ("plain", "spec") and compare.parse_args(["--spec-first"]).phases == ("spec", "plain")
    monkeypatch.setenv("VLLM_PYTHON", "/opt/v/bin/python")
    args = compare.parse_args(["--systems", "vllm", "tandem", "--max-tokens", "16", "--num-prompts", "2", "--repeats",
                               "1", "--dtype", "float32", "--json"])
    assert args.dtype == "float32" and args.vllm_python == "/opt/v/bin/python" and args.systems == ["vllm", "tandem"]
    assert (args.max_tokens, args.num_prompts, args.repeats, args.json) == (16, 2, 1, "-")
    for bad in (["--systems", "tandem", "sglang"], ["--systems", "vllm", "vllm"], ["--systems", "tandem,vllm"],
                ["--repeats", "0"], ["--threads", "0"], ["--dtype", "float16"], ["--draft-vocab", "-1"]):
        with pytest.raises(SystemExit):
            compare.parse_args(bad)


def test_vllm_gets_bound_threads_and_its_kv_space(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    env = workers.vllm_env(compare.parse_args(["--threads", "2", "--kv-space", "4", "--vllm-python", sys.executable]))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert "PYTHONPATH" not in env


def test_tandem_gets_vllms_preload_unless_asked_not_to(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    python = str(venv / "bin" / "python")
    monkeypatch.setenv("LD_PRELOAD", "/elsewhere/libfoo.so")
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    args = compare.parse_args(["--vllm-python", python])
    iomp = str(venv / "lib" / "libiomp5.so")
    assert workers.preload(args).split(":")[-1] == iomp
    assert workers.tandem_env(args)["LD_PRELOAD"] == workers.vllm_env(args)["LD_PRELOAD"] == workers.preload(args)
    assert workers.tandem_env(args)["PYTHONPATH"] == "/somewhere"  # tandem's side imports tandem from it
    (venv / "lib" / "libiomp5.so").unlink()
    assert iomp not in workers.preload(args)
    assert "LD_PRELOAD" not in workers.tandem_env(compare.parse_args(["--vllm-python", python, "--tandem-no-preload"]))


def test_the_tandem_workers_loading_logs_reach_the_echoed_lines(capsys: pytest.CaptureFixture[str]) -> None:
    """While its engines load, the worker writes tandem's INFO lines (a cold compile's per-class progress) as
    `tandem ...` lines, which the comparison echoes; once loaded, INFO is quiet again."""
    import logging

    from tandem.bench.vllm_compare_tandem import loading_progress

    runner_log = logging.getLogger("tandem.core.runner")
    with loading_progress():
        runner_log.info("compiled shape class %d of 6", 2)
    runner_log.info("a line of the timed runs")
    err = capsys.readouterr().err
    assert "tandem (loading) compiled shape class 2 of 6\n" in err
    assert "a line of the timed runs" not in err
    assert logging.getLogger("tandem").level == logging.NOTSET and not logging.getLogger("tandem").handlers
