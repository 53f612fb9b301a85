"""The command line, driven as a user would: make tiny models, generate, bench, and get clear errors that name
the flag at fault."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from tandem.cli.main import main


@pytest.fixture(scope="module")
def cli_models(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli-tiny")
    assert main(["models", "make-tiny", str(out), "--seed", "3"]) == 0
    return out


def _generate(capsys, models, *extra: str) -> dict:
    code = main(["generate", "def add(a, b):", "--target", str(models / "target"), "--draft", str(models / "draft"),
                 "--temperature", "0", "--max-tokens", "24", "--ignore-eos", "--dtype", "float32", "--json", *extra])
    assert code == 0
    return json.loads(capsys.readouterr().out)


def test_generate_json_and_no_spec_agree(capsys, cli_models) -> None:
    spec = _generate(capsys, cli_models, "--fixed-k", "2")
    plain = _generate(capsys, cli_models, "--no-spec")
    assert {"text", "token_ids", "finish_reason", "stats"} <= spec.keys()
    assert spec["token_ids"] == plain["token_ids"] and len(spec["token_ids"]) == 24
    assert spec["finish_reason"] == "length" and spec["stats"]["drafted"] > 0
    assert plain["stats"]["drafted"] == 0 and not plain["speculative"]


def test_generate_with_a_prediction_and_min_tokens(capsys, cli_models, tmp_path) -> None:
    plain = _generate(capsys, cli_models, "--no-spec")
    expected = tmp_path / "expected.txt"
    expected.write_text(plain["text"], encoding="utf-8")
    predicted = _generate(capsys, cli_models, "--prediction", str(expected), "--min-tokens", "20")
    assert predicted["token_ids"] == plain["token_ids"] and predicted["stats"]["drafted"] == 0
    assert "accepted_prediction_tokens" in predicted["stats"]
    assert main(["generate", "x", "--target", str(cli_models / "target"), "--prediction",
                 str(tmp_path / "missing.txt")]) == 2
    assert "prediction: cannot read" in capsys.readouterr().err
    assert main(["generate", "x", "--target", str(cli_models / "target"), "--max-tokens", "4", "--min-tokens",
                 "5"]) == 2
    assert "min-tokens" in capsys.readouterr().err


def test_generate_with_prompt_lookup(capsys, cli_models) -> None:
    """The target alone drafting from its own context: a prompt that repeats itself gives the lookup runs to offer,
    and the output is plain decoding's."""
    outputs = []
    for extra in ([], ["--prompt-lookup"]):
        assert main(["generate", "ab ab ab ab ab ab ab ab", "--target", str(cli_models / "target"), "--no-spec",
                     "--temperature", "0", "--max-tokens", "48", "--ignore-eos", "--dtype", "float32", "--json",
                     *extra]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    plain, looked_up = outputs
    assert looked_up["token_ids"] == plain["token_ids"]
    assert looked_up["stats"]["lookup_rounds"] > 0 and plain["stats"]["lookup_rounds"] == 0


def test_generate_streams_text(capsys, cli_models) -> None:
    code = main(["generate", "hi", "--target", str(cli_models / "target"), "--draft", str(cli_models / "draft"),
                 "--chat", "--temperature", "0.7", "--seed", "1", "--max-tokens", "10", "--dtype", "float32"])
    captured = capsys.readouterr()
    assert code == 0 and "tokens" in captured.err and captured.out.strip()


@pytest.mark.parametrize(("args", "message"), [
    (["--temperature", "-1"], "error: --temperature:"),
    (["--top-p", "0"], "error: --top-p:"),
    (["--max-tokens", "0"], "error: --max-tokens:"),
    (["--k-max", "99"], "error: --k-max:"),
    (["--fixed-k", "-1"], "error: --fixed-k: must be between 0 and 32, got -1"),  # the flag given, not --k-max
    (["--device", "quantum"], "error: --device:"),
    (["--kv-tokens", "-5"], "error: --kv-tokens: must be non-negative"),
    (["--retain-tokens", "-1"], "error: --retain-tokens: must be non-negative"),
    (["--stop-token-id", "-1"], "error: --stop-token-id: stop token ids must be non-negative"),
    (["--stop-token-id", "999999"], "error: --stop-token-id: [999999] are outside the vocabulary"),  # as a server says
])
def test_bad_arguments_give_clear_errors(capsys, cli_models, args: list[str], message: str) -> None:
    code = main(["generate", "x", "--target", str(cli_models / "target"), "--draft", str(cli_models / "draft"), *args])
    assert code == 2
    assert message in capsys.readouterr().err


def test_eager_and_compile_exclude_each_other(capsys, cli_models) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["generate", "x", "--target", str(cli_models / "target"), "--eager", "--compile"])
    assert exited.value.code == 2
    assert "--compile: not allowed with argument --eager" in capsys.readouterr().err


@pytest.mark.parametrize("where", [[], ["--address", "127.0.0.1:1"]])
@pytest.mark.parametrize("seed", ["-1", str(2**63)])
def test_a_seed_out_of_range_is_refused_the_same_way_locally_and_on_a_gateway(capsys, where, seed) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["generate", "x", "--seed", seed, *where])
    assert exited.value.code == 2
    assert f"--seed: must be a non-negative integer below 2**63, got {seed}" in capsys.readouterr().err


def test_compile_says_why_the_start_is_slow(capsys) -> None:
    import argparse

    from tandem.cli.common import announce_compile

    announce_compile(argparse.Namespace(compile="none"))
    assert capsys.readouterr().err == ""
    announce_compile(argparse.Namespace(compile="all"))
    assert "--compile: each model's decode forwards compile before the first request" in capsys.readouterr().err
    announce_compile(argparse.Namespace(compile="draft"))
    assert "--compile-draft: the draft's decode forwards compile" in capsys.readouterr().err


def test_compile_draft_compiles_the_draft_alone(capsys, cli_models) -> None:
    """`--compile-draft` loads the draft to compile its decode forwards and the target to run eagerly; it excludes
    `--compile` and `--eager`. Nothing compiles here: compiling starts when a runner warms up."""
    import argparse

    from tandem.cli.common import add_model_options, load_models

    parser = argparse.ArgumentParser()
    add_model_options(parser)
    assert [parser.parse_args(flags).compile for flags in ([], ["--compile"], ["--compile-draft"])] == [
        "none", "all", "draft"]
    for clash in (["--compile", "--compile-draft"], ["--eager", "--compile-draft"]):
        with pytest.raises(SystemExit):
            parser.parse_args(clash)
    capsys.readouterr()
    args = parser.parse_args(["--target", str(cli_models / "target"), "--draft", str(cli_models / "draft"),
                              "--device", "cpu", "--dtype", "float32", "--compile-draft"])
    target, draft = load_models(args, speculate=True)
    assert (draft.compile, target.compile) == (True, False)
    target, draft = load_models(args, speculate=False)
    assert (draft, target.compile) == (None, False)


def test_kv_tokens_sets_the_runners_budget(capsys, cli_models) -> None:
    budgeted = _generate(capsys, cli_models, "--kv-tokens", "8192")
    assert budgeted["token_ids"] == _generate(capsys, cli_models)["token_ids"]
    code = main(["generate", "x", "--target", str(cli_models / "target"), "--draft", str(cli_models / "draft"),
                 "--kv-tokens", "8"])
    assert code == 2  # not even calibration fits: a clear error, not a traceback
    error = capsys.readouterr().err  # one stream: no --max-batch to lower (generate has none)
    assert "--kv-tokens: a KV budget of 8 tokens cannot hold the sequence calibration times" in error
    assert error.rstrip().endswith("raise --kv-tokens"), error
    # The figure it names is what calibration needs in all (it named the step that failed: 31, then 33, ...).
    needed = int(error.split("(it needs ")[1].split(")")[0])
    for budget, code in ((needed - 1, 2), (needed, 0)):
        assert main(["generate", "x", "--target", str(cli_models / "target"), "--draft", str(cli_models / "draft"),
                     "--kv-tokens", str(budget), "--max-tokens", "2"]) == code
        capsys.readouterr()


def test_unknown_model_fails_without_traceback(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "tandem", "generate", "x", "--target", str(tmp_path / "nope"),
                           "--no-spec"], capture_output=True, text=True, timeout=120,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "TANDEM_HOME": str(tmp_path),
                               **{k: v for k, v in __import__("os").environ.items() if k == "PYTHONPATH"}})
    assert proc.returncode == 2
    assert proc.stderr.startswith("error:") and "Traceback" not in proc.stderr


def test_generate_json_to_a_file_still_streams_the_text(capsys, cli_models, tmp_path) -> None:
    out = tmp_path / "reports" / "generate.json"
    streamed = _generate_text(capsys, cli_models, "--json", str(out))
    written = json.loads(out.read_text())
    assert streamed.out == written["text"] + "\n" and "finish: length" in streamed.err
    assert written["token_ids"] == _generate(capsys, cli_models)["token_ids"]  # `--json` alone: stdout


def test_a_prompt_taken_by_json_as_its_path_is_named(capsys, cli_models, tmp_path) -> None:
    """`--json [PATH]` takes the word after it: `tandem generate --json hi` has no prompt, and says why."""
    assert main(["generate", "--target", str(cli_models / "target"), "--json", str(tmp_path / "hi")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: prompt: missing: --json took") and "--json -- PROMPT" in err
    assert not (tmp_path / "hi").exists()
    assert main(["generate", "--target", str(cli_models / "target")]) == 2
    assert capsys.readouterr().err == "error: prompt: missing\n"
    assert main(["generate", "--target", str(cli_models / "target"), "--no-spec", "--max-tokens", "2", "--json", "--",
                 "hi"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"]  # the JSON on stdout


def test_generate_summary_gives_an_acceptance_rate_only_where_drafts_were_checked(capsys, cli_models) -> None:
    """`--no-spec` printed "acceptance 0.00", read as every draft rejected."""
    assert ", acceptance 0." in _generate_text(capsys, cli_models, "--fixed-k", "2").err.splitlines()[-1]
    plain = _generate_text(capsys, cli_models, "--no-spec").err.splitlines()[-1]
    assert plain.startswith("[") and "finish: length]" in plain and "acceptance" not in plain, plain


def _generate_text(capsys, models, *extra: str):
    code = main(["generate", "def add(a, b):", "--target", str(models / "target"), "--draft", str(models / "draft"),
                 "--temperature", "0", "--max-tokens", "24", "--ignore-eos", "--dtype", "float32", *extra])
    assert code == 0
    return capsys.readouterr()


def _bench(models, *extra: str) -> int:
    return main(["bench", "--target", str(models / "target"), "--draft", str(models / "draft"), "--dtype", "float32",
                 "--max-tokens", "12", "--num-prompts", "2", *extra])


def test_bench_reports_all_methods(capsys, cli_models, tmp_path) -> None:
    # A fixed k: whether the adaptive policy drafts follows this run's timings, and on a loaded machine the tiny
    # pair's may say plain decoding pays (the CI once saw tau 0); the report's speculation fields need drafts.
    out = tmp_path / "bench.json"
    assert _bench(cli_models, "--fixed-k", "2", "--json", str(out)) == 0
    report = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == report  # with PATH the report is also the command's output
    for key in ("plain", "hf_assisted", "tandem"):
        assert report[key]["tok_s"] > 0 and report[key]["tokens"] > 0
    tandem = report["tandem"]
    assert 0.0 <= tandem["alpha"] <= 1.0 and tandem["tau"] >= 1.0 and 1.0 <= tandem["mean_k"] <= 2.0, tandem
    assert tandem["draft_failures"] == 0 and tandem["fallback_round_share"] == 0.0, tandem
    assert report["bound"] > 0 and report["ratio_to_bound"] > 0
    assert report["greedy_identical_to_plain"] == "2/2" and report["config"]["prompts"] == 2


def test_a_json_path_it_cannot_write_is_refused_before_the_run(capsys, cli_models, tmp_path) -> None:
    """Found after the run, the report was lost with a traceback (IsADirectoryError)."""
    (tmp_path / "file").write_text("")
    for path, why in ((tmp_path, "is a directory; name a file in it"), (tmp_path / "file" / "r.json", "is a file")):
        with pytest.raises(SystemExit) as exited:
            _bench(cli_models, "--json", str(path))
        error = capsys.readouterr().err
        assert exited.value.code == 2 and "argument --json: " in error and why in error, error


def test_bench_counts_every_token_of_a_multi_step_round(capsys, cli_models) -> None:
    """--decode-steps 4 decodes up to 4 tokens (4 target forwards) in one verify call: tokens per round and the
    bytes of weights read count them all, so the bound stays a bound (ratio_to_bound read 3.19 when a round counted
    one token and one forward)."""
    assert _bench(cli_models, "--methods", "plain", "tandem", "--fixed-k", "0", "--decode-steps", "4",
                  "--max-tokens", "16", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    tandem, config = report["tandem"], report["config"]
    rounds = sum(report["tandem"]["rounds_by_k"].values())
    assert rounds < tandem["tokens"] and report["tau_all_rounds"] == round(tandem["tokens"] / rounds, 4), report
    expected = tandem["tokens"] * config["target_weight_bytes"] / tandem["seconds"] / 1e9  # one forward per token
    assert abs(tandem["weight_gb_s"] - expected) <= 0.01 * expected, (tandem, expected)


def test_generate_and_bench_calibrate_single_sequences_alone(capsys, cli_models, caplog) -> None:
    """Both run one sequence at a time, so their calibration times no batch: with the real pair on CPU-B, 42 calls
    in 7.4 s where the default --max-batch of 16 made 134 in 32.5 s (docs/performance.md, "Start-up: calibration")."""
    with caplog.at_level(logging.INFO, logger="tandem"):
        _generate(capsys, cli_models)
        assert _bench(cli_models, "--methods", "plain", "tandem", "--json") == 0
    calibrated = [record.getMessage() for record in caplog.records if record.getMessage().startswith("calibrated in")]
    assert len(calibrated) == 2 and all(line.endswith("; rows 1)") for line in calibrated), calibrated


def test_generate_keeps_its_costs_for_the_next_run_as_serve_does(capsys, cli_models, caplog, tmp_path,
                                                                   monkeypatch) -> None:
    """The default file ($TANDEM_CALIBRATION_FILE here; calibration.json under $TANDEM_HOME without it): the first
    run calibrates and stores, the next reuses and gives the same tokens; `--calibration-file ''` calibrates."""
    costs = tmp_path / "calibration.json"
    monkeypatch.setenv("TANDEM_CALIBRATION_FILE", str(costs))
    runs = []
    for flags in ((), (), ("--calibration-file", "")):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tandem"):
            runs.append((_generate(capsys, cli_models, *flags)["token_ids"], caplog.text))
        if not flags:
            assert costs.exists()
    (first, calibrated), (second, reused), (third, again) = runs
    assert "calibrated in" in calibrated and "costs stored in" in calibrated
    assert "calibration: reusing" in reused and "calibrated in" not in reused
    assert "calibrated in" in again and "reusing" not in again
    assert first == second == third


def test_bench_methods_are_space_separated_and_json_alone_prints(capsys, cli_models) -> None:
    assert _bench(cli_models, "--methods", "plain", "tandem", "--json") == 0
    lines = capsys.readouterr().out.splitlines()
    report = json.loads(lines[-1])  # one object on one line
    assert len(lines) == 1 and {"plain", "tandem"} <= report.keys()
    assert "hf_plain" not in report and "hf_assisted" not in report
    with pytest.raises(SystemExit) as exited:
        _bench(cli_models, "--methods", "plain,tandem")
    assert exited.value.code == 2 and "invalid choice: 'plain,tandem'" in capsys.readouterr().err


def test_bench_prompts_take_a_set_name_or_a_file(capsys, cli_models, tmp_path) -> None:
    from tandem.bench.prompts import load_prompts

    prompts = tmp_path / "one.jsonl"
    prompts.write_text(json.dumps({"prompt": "def mul(a, b):"}) + "\n")
    assert _bench(cli_models, "--methods", "plain", "--prompts", str(prompts), "--json") == 0
    assert json.loads(capsys.readouterr().out)["config"]["prompts"] == 1
    assert _bench(cli_models, "--methods", "plain", "--prompts", "bench", "--num-prompts", "3", "--json") == 0
    assert json.loads(capsys.readouterr().out)["config"]["prompts"] == min(3, len(load_prompts("bench")))
    assert _bench(cli_models, "--prompts", str(tmp_path / "none.jsonl")) == 2
    assert "error: --prompts: " in capsys.readouterr().err


def test_bench_parser_names_the_benchmarks_methods() -> None:
    """The parser names them itself (tandem.bench.core imports torch): the two lists must agree."""
    from tandem.bench import core
    from tandem.cli import bench

    assert bench.METHODS == core.METHODS


def test_bench_rejects_bad_prompt_file(capsys, cli_models, tmp_path) -> None:
    bad = tmp_path / "p.jsonl"
    bad.write_text("not json\n")
    code = main(["bench", "--target", str(cli_models / "target"), "--draft", str(cli_models / "draft"),
                 "--prompts", str(bad)])
    assert code == 2 and "line 1" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--no-prefix-cache"], ["--retain-tokens", "0"]])
def test_bench_has_no_cache_reuse_flags(capsys, flag: list[str]) -> None:
    """bench computes every prompt whole: the flags were accepted and did nothing."""
    with pytest.raises(SystemExit) as exited:
        main(["bench", *flag])
    assert exited.value.code == 2 and f"unrecognized arguments: {flag[0]}" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["pools", "status"], ["gateway", "--pools", "p", "--port", "0"]])
def test_a_ray_address_where_nothing_listens_fails_at_once(capsys, command: list[str]) -> None:
    import socket

    with socket.socket() as sock:  # bound, never listening: connections are refused
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        code = main([*command, "--ray-address", address])
    assert code == 2
    assert f"error: no Ray cluster answers at {address}" in capsys.readouterr().err


def test_make_tiny_into_a_file_names_it(tmp_path, capsys) -> None:
    taken = tmp_path / "a-file"
    taken.write_text("x")
    assert main(["models", "make-tiny", str(taken)]) == 2
    assert capsys.readouterr().err.strip() == f"error: dir: {taken} is a file; name a directory (made if missing)"
