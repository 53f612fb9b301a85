"""A serving loop whose engine fills this process's CPUs steps again only after the event loop has run what the last
step's outputs woke (gateway.loop `settle`), and `tandem serve --in-process` on a CPU turns that on by itself."""

from __future__ import annotations

import asyncio
import os

import torch

from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.engines.local import build_engine
from tandem.gateway.handles import Submission
from tandem.gateway.loop import EngineLoop

PROMPTS = [[72, 101, 108, 108, 111, 44, 32, 119], [40, 41, 42, 43, 44, 45, 46, 47], [97, 98, 99]]


class _Watched:
    """An engine that notes, as each step starts on the engine thread, how many steps had given outputs and how many
    updates the clients had read by then."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.read = 0
        self.given = 0
        self.at_step: list[tuple[int, int]] = []

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def step(self):
        self.at_step.append((self.given, self.read))
        outputs = self._engine.step()
        self.given += len(outputs)
        return outputs


def _steps_seen(tiny_models, settle: bool) -> tuple[list[tuple[int, int]], list[list[int]]]:
    target, draft, _ = tiny_models
    engine = _Watched(build_engine(target, draft, EngineConfig(spec=SpecConfig(k_max=3, k_init=3, adaptive=False),
                                                               calibrate=False)))

    async def run() -> list[list[int]]:
        loop = EngineLoop(engine, settle=settle)
        await loop.start()

        async def read(index: int) -> list[int]:
            params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
            tokens = []
            async for update in await loop.submit(Submission(PROMPTS[index], params, f"r{index}")):
                engine.read += 1
                tokens.extend(update.token_ids)
            return tokens

        try:
            return await asyncio.gather(*[read(i) for i in range(len(PROMPTS))])
        finally:
            await loop.close()

    outputs = asyncio.run(run())
    return engine.at_step, outputs


def test_a_settling_loop_steps_after_the_clients_read_the_last_steps_outputs(tiny_models, monkeypatch) -> None:
    # The wait's bound raised: on a loaded test host the event loop may take longer than a step's 50 ms to be
    # scheduled, and the bound (which then lets the step go) is not what this test is about.
    monkeypatch.setattr("tandem.gateway.engine_thread.SETTLE_MAX_S", 10.0)
    at_step, settled = _steps_seen(tiny_models, settle=True)
    assert len(at_step) > 5 and all(read == given for given, read in at_step), at_step
    _, unsettled = _steps_seen(tiny_models, settle=False)
    assert settled == unsettled and all(len(tokens) == 20 for tokens in settled)


def test_serve_in_process_settles_where_its_forwards_fill_the_cpus(tiny_dirs, monkeypatch) -> None:
    from tandem.engines.local import build_local_backends
    from tandem.engines.options import Arm, LocalOptions
    from tandem.gateway.loading import serving_loop
    from tandem.gateway.options import GatewayOptions

    cpus = len(os.sched_getaffinity(0))
    arms = (Arm("", str(tiny_dirs.draft), EngineConfig(calibrate=False)),)
    threads = torch.get_num_threads()
    try:
        every = build_local_backends(str(tiny_dirs.target), arms, LocalOptions("cpu", "float32", threads=cpus))[""]
        fewer = build_local_backends(str(tiny_dirs.target), arms, LocalOptions("cpu", "float32", threads=1))[""]
    finally:
        torch.set_num_threads(threads)
    assert every.fills_cpus and fewer.fills_cpus == (cpus == 1)
    monkeypatch.delenv("TANDEM_SETTLE", raising=False)
    assert serving_loop(every, GatewayOptions(), None, None).settle
    monkeypatch.setenv("TANDEM_SETTLE", "0")  # the override, both ways
    assert not serving_loop(every, GatewayOptions(), None, None).settle
    monkeypatch.setenv("TANDEM_SETTLE", "1")
    assert serving_loop(fewer, GatewayOptions(), None, None).settle
