"""Counts what a block of torch code allocates, on CPU or GPU: every allocation the profiler sees (operator outputs,
temporaries, copies made inside composite operators such as reshape), and how far memory in use peaked above
where it started.

CPU runs thus count the same copies (torch.cat, padding, repeated key/value heads, gathers) that a GPU allocator's
statistics would show, which is what tells a cache written in place from one copied every step.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile


class AllocationMeter:
    def __init__(self) -> None:
        self.allocated = 0  # bytes of every allocation in the block
        self.peak = 0  # the most the memory in use rose above where it was when the block started
        self.by_op: Counter[str] = Counter()  # allocated bytes by the outermost operator that asked for them

    def __enter__(self) -> AllocationMeter:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._profile = profile(activities=activities, profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        events = sorted(_allocations(self._profile.profiler.kineto_results.experimental_event_tree()),
                        key=lambda event: event.start_time_ns)
        live: Counter[str] = Counter()
        for event in events:
            size, device = event.extra_fields.alloc_size, str(event.extra_fields.device)
            live[device] += size
            self.peak = max(self.peak, sum(live.values()))
            if size > 0:
                self.allocated += size
                self.by_op[_outermost(event)] += size


def _allocations(events):
    for event in events:
        if event.tag == _EventType.Allocation:
            yield event
        yield from _allocations(event.children)


def _outermost(event) -> str:
    name = "(outside operators)"
    parent = event.parent
    while parent is not None:
        name, parent = parent.name, parent.parent
    return name
