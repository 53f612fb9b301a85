"""Hub ids must be pinned to a commit (tandem.models.hub), loaded from a hand-made local hub cache (no network)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tandem.errors import InvalidArgument, ModelNotFound
from tandem.models import hub
from tandem.models.hub import HubRef, parse_hub_id, pin_spec
from tandem.models.loader import load_model

CPU = torch.device("cpu")
MAIN = "a" * 40  # what refs/main points to
OLD = "b" * 40  # an older commit, with another model in it
REPO = "tandem-test/tiny"


@pytest.fixture
def hub_cache(tiny_dirs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A hub cache in huggingface_hub's layout: main holds the tiny target, commit OLD the tiny draft."""
    import huggingface_hub.constants

    repo = tmp_path / "hub" / f"models--{REPO.replace('/', '--')}"
    for commit, source in ((MAIN, tiny_dirs.target), (OLD, tiny_dirs.draft)):
        shutil.copytree(source, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo


def load(spec: str, **kwargs):
    return load_model(spec, device=CPU, dtype=torch.float32, progress=False, **kwargs)


def layers(loaded) -> int:
    return loaded.model.config.num_hidden_layers


def test_parse_hub_id() -> None:
    assert parse_hub_id("org/name") == HubRef("org/name")
    assert not parse_hub_id("org/name").pinned
    assert parse_hub_id(f"org/name@{MAIN}") == HubRef("org/name", MAIN)
    assert parse_hub_id(f"org/name@{MAIN}").pinned
    assert parse_hub_id("org/name@" + "AB" * 20) == HubRef("org/name", "ab" * 20)  # kept in lower case
    for movable in ("org/name@main", "org/name@v1.0", f"org/name@{MAIN[:12]}"):
        assert not parse_hub_id(movable).pinned
    for not_an_id in ("org/name@", "a/b/c", "org/name@x@y", "has space/x"):
        assert parse_hub_id(not_an_id) is None


def test_unpinned_hub_id_is_refused_before_any_network_access(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub, "_hub_reachable", lambda: pytest.fail("probed the hub for an unpinned id"))
    for spec in ("org/name", "org/name@main"):
        with pytest.raises(InvalidArgument) as caught:
            load(spec)
        message = str(caught.value)
        assert "--allow-unpinned" in message and "org/name@<40-hex commit>" in message
        with pytest.raises(InvalidArgument):
            pin_spec(spec)


def test_registry_names_and_paths_need_no_pin(tiny_dirs) -> None:
    for spec in ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder", str(tiny_dirs.target), "./absent.gguf"):
        assert pin_spec(spec) == spec


def test_pinned_hub_id_loads_that_commit(hub_cache: Path, tiny_dirs) -> None:
    pinned_old = load(f"{REPO}@{OLD}")
    assert layers(pinned_old) == layers(load(str(tiny_dirs.draft)))  # not main's model
    assert layers(load(f"{REPO}@{MAIN}")) != layers(pinned_old)
    assert pin_spec(f"{REPO}@{OLD}") == f"{REPO}@{OLD}"


def test_allow_unpinned_resolves_the_current_commit_once(
    hub_cache: Path, tiny_dirs, caplog: pytest.LogCaptureFixture
) -> None:
    assert pin_spec(REPO, allow_unpinned=True) == f"{REPO}@{MAIN}"
    assert f"{REPO}@{MAIN}" in caplog.text  # logged, so that it can be pinned next time
    assert layers(load(REPO, allow_unpinned=True)) == layers(load(str(tiny_dirs.target)))


def test_pinned_commit_missing_from_the_cache_is_not_found(hub_cache: Path) -> None:
    with pytest.raises(ModelNotFound, match="local hub cache"):
        load(f"{REPO}@{'c' * 40}")


@pytest.mark.parametrize("command", [
    ["generate", "hi"], ["bench"], ["serve", "--in-process"], ["pools", "start", "--name", "p"],
])
def test_commands_refuse_an_unpinned_hub_id(command: list[str], capsys: pytest.CaptureFixture) -> None:
    from tandem.cli.main import main

    assert main([*command, "--target", "org/name"]) == 2
    error = capsys.readouterr().err
    assert "'org/name'" in error and "--allow-unpinned" in error


def test_allow_unpinned_pins_the_command_arguments(hub_cache: Path) -> None:
    import argparse

    from tandem.cli.common import add_model_options, pin_model_args

    parser = argparse.ArgumentParser()
    add_model_options(parser)
    args = parser.parse_args(["--target", REPO, "--draft", f"{REPO}@{OLD}", "--allow-unpinned"])
    pin_model_args(args)
    assert (args.target, args.draft) == (f"{REPO}@{MAIN}", f"{REPO}@{OLD}")
    with pytest.raises(InvalidArgument, match="--allow-unpinned"):
        pin_model_args(parser.parse_args(["--target", REPO]))
