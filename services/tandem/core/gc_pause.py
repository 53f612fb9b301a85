"""Python's cyclic garbage collector paused for a stretch of work, on any number of threads at once.

Loading a model builds hundreds of thousands of objects that live on (a tokenizer's vocabulary and merges, parsed
from JSON twice per tokenizer), and the collector walks all of them at each full collection they set off: nine
collections, about 1.5 s of a 15 s load of the real pair on a 2-core CPU (docs/performance.md, "Start-up: no
garbage collection while models load"). A CUDA graph's capture must not run a collection either (core.cuda_graphs).
Nor should a long prompt's scores become a million small tuples (core.prompt_logprobs): the full collection they
set off held an in-process gateway's event loop for 0.28-0.36 s.
Such stretches can overlap on several threads (a gateway's loader beside an engine loop), so the pause is counted:
the collector runs again when the last holder leaves, and only if it ran before the first came.

Once a serving process has loaded, `freeze_loaded_heap` takes what it loaded out of every later collection: a full
collection of the engines an in-process gateway holds (the real pair, ~450k objects) took 0.31-0.35 s, holding the
GIL (the event loop and the engine thread with it); after the freeze 3-7 us (docs/performance.md, "The loaded heap
out of the collector's way").
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_holders = 0
_was_enabled = False


@contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection inside (reference counting still frees what it can)."""
    global _holders, _was_enabled
    with _lock:
        if _holders == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _was_enabled:
                gc.enable()


def freeze_loaded_heap() -> int:
    """Collect once, then move every object that survives to the collector's permanent generation, which no
    collection walks: for a process's entry point once it has loaded what it serves with (a model, a tokenizer, a
    gateway's stack), never for a library call (a test process builds and drops engines; cycles frozen with them
    would never be freed). Objects made later are collected as before. Returns the objects frozen so far."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
