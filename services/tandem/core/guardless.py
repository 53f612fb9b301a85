"""Compiled forwards called without dynamo's guard check once their shape class has run.

A function compiled by torch.compile checks, on every call, the guards of the graphs compiled for it until one
passes. For a Qwen2.5 decoder those are thousands of conditions: every parameter's type, dtype and shape, the
config's fields, each module and builtin the traced code read. They cost about 2 ms a forward on a 2-core CPU
(docs/bench/guardless-v1.json: a one-row w8a8 draft forward runs 1.098x faster without them, the target's 1.024x),
and for the runner's static forwards their answer never changes once a shape class has run: the model, its config
and its parameters stay what they were, and what tells the compiled graphs apart is whether the cache's slots, the
rows and the width are 1 (dynamic shapes specialise sizes 0 and 1; core.cuda_graphs passes that as the class key).

So the first call of a class goes through torch.compile, compiling if it must. The graph it ran is then the first
of this function's cache entries, under an equal backend, whose guards pass for the same arguments: the order and
test dynamo itself looks them up by. Dynamo runs a graph by executing a rewritten code object for the function,
which takes the same arguments, cells and globals as the original (it loads the graph's inputs, calls the compiled
graph and returns its outputs), so that code, made a plain function, serves the class's later calls directly.
vLLM does the same for its single graph (the bytecode hook of its TorchCompileWithNoGuardsWrapper). The cache
entries are read through dynamo's debugging accessor; where a PyTorch lacks it, the calls stay guarded.

That code reads each symbolic size the graph takes through a helper of dynamo's (`call_size`, `call_stride`,
`call_storage_offset`), each wrapped so that dynamo does not trace it: every call switches dynamo's frame hook off
and on again, microseconds each (a forward of the 0.5B w8a8 draft read 458 sizes before its layers' weights were
marked fixed-size, core.packed_linear.fixed_size; 98 since). The direct calls run outside any compiled frame, where
the hook is off anyway, so their code reads those helpers unwrapped.

`check_guards` re-runs the guards on every call and raises GuardMismatch where they pick another graph than the
class's. The tests run with it on (tests/conftest.py), which is how the class key is known to cover what the
guards test.
"""

from __future__ import annotations

import inspect
import logging
import types
from collections.abc import Callable, Hashable
from functools import cache
from typing import Any

import torch

log = logging.getLogger(__name__)


class GuardMismatch(AssertionError):
    """The guards pick another compiled graph than the shape class's (raised only under `check_guards`)."""


class GuardlessForward:
    """Calls `compiled` (torch.compile of `function`, a function or a bound method) for a class's first call, its
    compiled code directly from then on."""

    check_guards = False  # the tests turn it on for every instance (tests/conftest.py)

    def __init__(self, function: Callable[..., Any], compiled: Callable[..., Any]) -> None:
        self.compiled = compiled
        self.func = getattr(function, "__func__", function)
        self.owner = getattr(function, "__self__", None)
        self.direct: dict[Hashable, Callable[..., Any]] = {}
        self.backend: object | None = None  # the backend of the graphs `compiled` runs: only those can serve it
        self.direct_calls = 0
        self.supported = True

    def __call__(self, key: Hashable, *args: Any) -> Any:
        # Grad and inference mode are global state the guards test too.
        key = (key, torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        direct = self.direct.get(key)
        if direct is None:
            return self._first_call(key, args) if self.supported else self.compiled(*args)
        if self.check_guards and self._entry_code(args) is not direct.__code__:
            raise GuardMismatch(f"the guards pick another compiled graph than that of shape class {key}")
        self.direct_calls += 1
        return direct(*args)

    def _first_call(self, key: Hashable, args: tuple) -> Any:
        try:
            before = {id(entry) for entry in self._entries()}
        except AttributeError as exc:  # a PyTorch whose cache entries look otherwise: its guarded calls, as before
            return self._unsupported(exc, self.compiled(*args))
        out = self.compiled(*args)
        try:
            if self.backend is None:  # a graph this call compiled tells the backend for certain
                new = [entry for entry in self._entries() if id(entry) not in before]
                self.backend = new[0].backend if new else None
            code = self._entry_code(args)
        except AttributeError as exc:
            return self._unsupported(exc, out)
        if code is not None:
            function = types.FunctionType(code, _unwrapped_helpers(self.func.__globals__, code), self.func.__name__,
                                          self.func.__defaults__, self.func.__closure__)
            self.direct[key] = function if self.owner is None else types.MethodType(function, self.owner)
        return out

    def _unsupported(self, exc: Exception, out: Any) -> Any:
        log.warning("compiled forwards keep dynamo's guard check: %s", exc)
        self.supported = False
        return out

    def _entries(self) -> list:
        from torch._dynamo import eval_frame  # loaded by then: compiling imported it

        return eval_frame._debug_get_cache_entry_list(self.func.__code__)

    def _entry_code(self, args: tuple) -> types.CodeType | None:
        """The code of the graph dynamo runs for `args`: the first cache entry whose guards pass, among those of
        an equal backend (dynamo's own test). The backend is known once a call of ours has compiled a graph; before
        that, `compiled` reused graphs of an equal backend, and the first entry that passes tells it (a process
        that compiles the function under several inductor options, as some benchmarks do, compiles anew for each,
        so there it is known)."""
        call = (self.owner, *args) if self.owner is not None else args
        frame_locals = inspect.getcallargs(self.func, *call)
        for entry in self._entries():
            if (self.backend is None or entry.backend == self.backend) and entry.guard_manager.check(frame_locals):
                self.backend = entry.backend
                return entry.code
        return None


class _UnwrappedSizes(types.ModuleType):
    """torch._dynamo.utils as the direct calls' code sees it: the tensor property helpers without the wrapper that
    keeps dynamo from tracing them, everything else dynamo's own."""

    def __init__(self, utils: types.ModuleType) -> None:
        super().__init__(utils.__name__)
        self.__dict__.update(utils.__dict__)
        self.call_size = lambda tensor, dim: tensor.size(dim)
        self.call_stride = lambda tensor, dim: tensor.stride(dim)
        self.call_storage_offset = lambda tensor: tensor.storage_offset()


@cache
def _unwrapped_utils() -> types.ModuleType:
    from torch._dynamo import utils

    return _UnwrappedSizes(utils)


def _unwrapped_helpers(globals_: dict[str, Any], code: types.CodeType) -> dict[str, Any]:
    """`globals_` with dynamo's import of its utils module, if `code` reads it, replaced by the unwrapped one. A copy:
    the names dynamo adds there (compiled graphs, imports) are in place once `code` has run, and do not change."""
    alias = "__import_torch_dot__dynamo_dot_utils"  # how dynamo names a module that its code imports
    if alias not in code.co_names or alias not in globals_:
        return globals_
    return {**globals_, alias: _unwrapped_utils()}
