"""The compile options: `--compile` and `--compile-draft` reach every runner they name (in-process and a worker's),
the scopes say which model of a pair compiles, eager and compile together are refused, and the compile benchmark
compares both engines of each kind."""

from __future__ import annotations

import pytest
import torch

from tandem.engines.local import build_engine
from tandem.engines.options import ClusterOptions, LocalOptions
from tandem.errors import InvalidArgument
from tandem.models.loader import load_model, load_pair
from tandem.workers.worker_base import WorkerConfig, load_runner

# On the worker that runs tests/test_compiled_forward.py: their compiles share inductor's caches.
pytestmark = pytest.mark.xdist_group("compiled_forward")


@pytest.mark.slow
def test_the_compile_option_reaches_every_runner(tiny_dirs) -> None:
    """`--compile` travels as LoadedModel.compile to the engine's runners and as WorkerConfig.compile to a worker's,
    `--compile-draft` to the draft's runner alone; without either a CPU runner has no static forwards. Eager and
    compile together are refused before any loading."""
    def load(path, compile: bool):
        return load_model(str(path), device=torch.device("cpu"), dtype=torch.float32, progress=False, compile=compile)

    for compile in (True, False):
        engine = build_engine(load(tiny_dirs.target, compile), load(tiny_dirs.draft, compile), kv_tokens=4096)
        runners = (engine.verifier.runner, engine.drafter.runner)
        assert all((r.graphs is not None and r.graphs.compiled) == compile for r in runners)
    # `--compile-draft`: the draft's runner compiles, the target's runs eagerly.
    draft, target = load_pair(str(tiny_dirs.draft), str(tiny_dirs.target), device=torch.device("cpu"),
                              dtype=torch.float32, progress=False, compile="draft")
    engine = build_engine(target, draft, kv_tokens=4096)
    assert engine.drafter.runner.graphs is not None and engine.drafter.runner.graphs.compiled
    assert engine.verifier.runner.graphs is None
    worker = load_runner(WorkerConfig(model=str(tiny_dirs.draft), device="cpu", dtype="float32", kv_tokens=4096,
                                      compile=True)).runner
    assert worker.graphs is not None and worker.graphs.compiled and worker.graphs.compile_error is None
    with pytest.raises(InvalidArgument, match="eager and compile"):
        load_model(str(tiny_dirs.target), device=torch.device("cpu"), dtype=torch.float32, eager=True, compile=True)
    for options in (LocalOptions, ClusterOptions):
        with pytest.raises(InvalidArgument, match="eager and compile"):
            options(eager=True, compile=True)


def test_compile_scopes_say_which_model_of_a_pair_compiles(tiny_dirs) -> None:
    """"draft" compiles the draft's runners alone, "all" (or True) both, "none" (or False) neither: in a pair loaded
    here and in the workers a cluster starts. Options keep the scope a bool stood for; an unknown one is refused."""
    from tandem.engines.cluster import _worker_common

    for scope, draft_compiles, target_compiles in (("draft", True, False), ("all", True, True), (True, True, True),
                                                   ("none", False, False)):
        draft, target = load_pair(str(tiny_dirs.draft), str(tiny_dirs.target), device=torch.device("cpu"),
                                  dtype=torch.float32, progress=False, compile=scope)
        assert (draft.compile, target.compile) == (draft_compiles, target_compiles)
        options = ClusterOptions(compile=scope)
        assert [_worker_common(options, draft=d, threads=None)["compile"] for d in (True, False)] == [draft_compiles,
                                                                                      target_compiles]
    assert LocalOptions(compile=True).compile == "all" and ClusterOptions(compile=False).compile == "none"
    with pytest.raises(InvalidArgument, match="compile: one of none, draft, all"):
        LocalOptions(compile="target")
    with pytest.raises(InvalidArgument, match="eager and compile"):
        ClusterOptions(eager=True, compile="draft")


@pytest.mark.slow
def test_compile_benchmark_compares_both_engines_of_each_kind(tiny_dirs, tmp_path) -> None:
    """tandem.bench.compile_ab on the tiny pair in float32: every section reported, and compiled tokens equal eager."""
    import json

    from tandem.bench import compile_ab

    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "ab.json"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "hello"}\n')
    # One thread, as every test runs (tests/conftest.py): inductor's code differs by thread count, so at the
    # benchmark's default of 2 nothing the earlier tests compiled served it (230 s of compiling, cold).
    assert compile_ab.main(["--target", str(tiny_dirs.target), "--draft", str(tiny_dirs.draft), "--dtype", "float32",
                            "--prompts", str(prompts), "--max-tokens", "8", "--repeats", "1", "--threads", "1",
                            "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for section in ("plain_b1", "plain_b2", "auto_b1", "auto_b2"):
        row = report[section]
        assert row["eager_tok_s"] > 0 and row["compiled_tok_s"] > 0 and row["identical"] == 2, (section, row)
    assert len(report["auto_b1"]["prompt_ratios"]) == 2 and report["compile_seconds"] > 0
    # what each engine drafted, per repeat at once: a plain engine drafts nothing
    assert report["plain_b2"]["drafted"] == {"eager": [0], "compiled": [0]} and report["plain_b1"]["alpha"] == {
        "eager": 0.0, "compiled": 0.0}
    assert all(len(runs) == 1 for runs in report["auto_b2"]["alpha"].values())
