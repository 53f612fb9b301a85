"""What every tandem /metrics endpoint carries about its own process, beside tandem's instruments: the families
prometheus_client exports by default (process_resident_memory_bytes, process_cpu_seconds_total, process_open_fds,
python_info, python_gc_collections_total, ...), which a scraper of any Python server expects; and how long Python's
cyclic garbage collector held the process, by generation. A collection holds the GIL, so its pause is latency that
every stream of a gateway, or every forward of a worker, pays: a full collection of a loaded heap took 0.25-0.35 s
before serving processes froze it (core.gc_pause.freeze_loaded_heap); these show whether any such pause remains.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator

from opentelemetry.metrics import CallbackOptions, Observation
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector

GENERATIONS = (0, 1, 2)
GENERATION = "cpython.gc.generation"  # OpenTelemetry's attribute for cpython.gc.* metrics

# Updated from the collector's own callback with arithmetic only: the callback runs inside whatever allocation set
# the collection off, so it must take no lock (an instrument's record() would, and that thread may hold it).
_paused_s = [0.0, 0.0, 0.0]
_longest_s = [0.0, 0.0, 0.0]
_started = [0.0]


def _on_collection(phase: str, info: dict) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
        return
    seconds = time.perf_counter() - _started[0]
    generation = info["generation"]
    _paused_s[generation] += seconds
    if seconds > _longest_s[generation]:
        _longest_s[generation] = seconds


def _timing() -> None:
    """Time every collection of this process from now on (once per process)."""
    if _on_collection not in gc.callbacks:
        gc.callbacks.append(_on_collection)


def _by_generation(values: list[float]) -> Callable[[CallbackOptions], Iterator[Observation]]:
    """An observable instrument's callback reading `values` (one per generation) at scrape time."""

    def observe(options: CallbackOptions) -> Iterator[Observation]:
        for generation in GENERATIONS:
            yield Observation(values[generation], {GENERATION: generation})

    return observe


def observe_process(registry: CollectorRegistry, meter) -> None:
    """The default process and Python families into `registry`, and the collector's pauses as `meter`'s."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    _timing()
    meter.create_observable_counter("tandem.process.gc_pause", [_by_generation(_paused_s)], unit="s",
                                    description="Time Python's cyclic garbage collector held this process (and its "
                                                "GIL), by generation, since it started.")
    meter.create_observable_gauge("tandem.process.gc_longest_pause", [_by_generation(_longest_s)], unit="s",
                                  description="The longest single collection since this process started, by "
                                              "generation.")
