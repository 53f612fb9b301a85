"""The garbage collector paused while models load (core.gc_pause): counted across threads, restored as it was; and a
serving process's loaded heap frozen out of later collections."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys
import threading
import weakref

import pytest
import torch

from models_pull_harness import write_tiny_gguf
from tandem.core.gc_pause import collector_paused, freeze_loaded_heap
from tandem.models.loader import load_model, load_models
from tandem.models.pull import convert_gguf

LOADERS = ("load_model", "load_models", "_write_converted")  # the paused functions (convert_gguf's work)


@pytest.fixture
def collections():
    """The automatic collections (any generation) that start while the test runs, each with the loader function
    running then, if any (the backlog collected as a pause ends runs in its wrapper, after the function returned)."""
    started: list[tuple[int, str | None]] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            frame, loading = sys._getframe(1), None
            while frame is not None and loading is None:
                loading = frame.f_code.co_name if frame.f_code.co_name in LOADERS else None
                frame = frame.f_back
            started.append((info["generation"], loading))

    gc.callbacks.append(seen)
    try:
        yield started
    finally:
        gc.callbacks.remove(seen)


def test_loading_a_model_runs_no_collection_and_turns_the_collector_back_on(tiny_dirs, collections) -> None:
    """Without the pause the same loads start dozens of collections (planted: undecorated, it fails)."""
    assert gc.isenabled()
    load_model(str(tiny_dirs.draft), device=torch.device("cpu"), dtype=torch.float32, progress=False)
    load_models([(str(tiny_dirs.target), {}), (str(tiny_dirs.draft), {})], device=torch.device("cpu"),
                dtype=torch.float32, progress=False)
    assert [loading for _, loading in collections if loading] == []
    assert gc.isenabled()
    collections.clear()
    _ = [[] for _ in range(5 * gc.get_threshold()[0])]  # enough new objects to start collections
    assert collections


def test_converting_a_pulled_gguf_runs_no_collection(tmp_path, collections) -> None:
    """A pull's conversion (models.pull.convert_gguf) builds the tokenizer from the GGUF's vocabulary: no collection
    walks it meanwhile; one runs as it ends, asked for (planted: undecorated, it fails)."""
    write_tiny_gguf(tmp_path / "tiny.gguf")
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").is_file()
    assert [loading for _, loading in collections if loading] == []
    assert gc.isenabled()
    collections.clear()
    _ = [[] for _ in range(5 * gc.get_threshold()[0])]  # enough new objects to start collections
    assert collections


def test_overlapping_pauses_on_two_threads_end_with_the_last() -> None:
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    states: dict[str, bool] = {}

    def first() -> None:
        with collector_paused():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    thread = threading.Thread(target=first)
    thread.start()
    first_in.wait(5)
    with collector_paused():
        second_in.set()
        first_out.wait(5)
        states["after the first left"] = gc.isenabled()
    thread.join(5)
    states["after both"] = gc.isenabled()
    assert states == {"after the first left": False, "after both": True}


def test_a_collector_off_before_the_pause_stays_off() -> None:
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.fixture
def unfrozen():
    """Nothing frozen as a test starts; what it froze moved back into the collector's care as it ends, so the test
    process frees its cycles as before."""
    gc.unfreeze()
    yield
    gc.unfreeze()


class _Node:
    """A weakly referable object to put in a reference cycle."""

    def __init__(self) -> None:
        self.other: _Node | None = None


def test_freezing_the_loaded_heap_takes_it_out_of_collections(unfrozen) -> None:
    """A full collection walks every tracked object; frozen ones it skips: a freeze collects first, so a cycle dropped
    before it is freed, not kept for good; a cycle kept through it is frozen; objects made later are not. (Counts are
    compared as at most: the test process's other threads free frozen objects meanwhile.)"""
    dropped, kept = _Node(), _Node()
    dropped.other, kept.other = _Node(), _Node()
    dropped.other.other, kept.other.other = dropped, kept
    gone = weakref.ref(dropped)
    del dropped
    frozen = freeze_loaded_heap()
    assert gone() is None  # collected by the freeze's collection, not frozen
    assert 0 < gc.get_freeze_count() <= frozen
    assert all(obj is not kept for obj in gc.get_objects())  # frozen: in no generation a collection walks
    later = [_Node() for _ in range(10)]
    assert any(obj is later[0] for obj in gc.get_objects())  # made after: collected as before
    assert gc.get_freeze_count() <= frozen
    del later


def test_a_served_gateway_freezes_its_heap_once_serving(tiny_models, unfrozen) -> None:
    """`tandem serve`'s loop (gateway.run.serve): once readiness is SERVING, the loaded engines are frozen before the
    ready line; a SIGTERM then drains it as ever."""
    from gateway_harness import tiny_backend
    from tandem.gateway.options import GatewayOptions
    from tandem.gateway.run import serve

    seen: list[int] = []

    def on_ready(_seconds: float) -> None:
        seen.append(gc.get_freeze_count())
        os.kill(os.getpid(), signal.SIGTERM)  # the loop's own handler drains the gateway

    assert gc.get_freeze_count() == 0
    asyncio.run(serve(tiny_backend(tiny_models[0], tiny_models[1]), GatewayOptions(port=0), on_ready=on_ready))
    assert seen and seen[0] > 0
