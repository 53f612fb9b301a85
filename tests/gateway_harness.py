"""Runs a real gateway on 127.0.0.1 (a free port) in a background event loop, for blocking tests to call."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import TypeVar

from tandem.core.config import EngineConfig, SpecConfig
from tandem.engines import Backend
from tandem.engines.local import build_engine
from tandem.gateway.arms import ArmRouterFactory
from tandem.gateway.handles import SessionStore
from tandem.gateway.options import GatewayOptions
from tandem.gateway.run import start_gateway
from tandem.gateway.server import Gateway
from tandem.gateway.validate import GatewayLimits

T = TypeVar("T")

CALL_TIMEOUT = 60.0


def tiny_backend(target, draft=None, kv_tokens: int = 0, max_batch: int = 16, **spec) -> Callable[[], Backend]:
    """A loader for build_engine on the tiny models (fixed k, no calibration, so runs are repeatable); `kv_tokens`:
    each runner's KV token budget (0: a share of free memory)."""
    config = EngineConfig(spec=SpecConfig(**({"adaptive": False, "k_init": 4} | spec)), calibrate=False,
                          max_batch=max_batch)

    def load() -> Backend:
        return Backend(build_engine(target, draft, config, kv_tokens=kv_tokens), target.tokenizer, "tiny-target",
                       "tiny-draft" if draft is not None else "")

    return load


def window_past_budget(load: Callable[[], Backend], window: int = 4096) -> Callable[[], Backend]:
    """`load`, its verifier saying a context window its KV budget cannot hold (as a pool's replicas unlike the first,
    whose info a gateway reads): requests pass the gateway's window check, and the engine refuses a sequence once
    it outgrows the budget, mid-generation."""

    def loaded() -> Backend:
        backend = load()
        backend.engine.verifier.context_window = window
        return backend

    return loaded


class ServerThread:
    def __init__(self, load: Callable[[], Backend | dict[str, Backend]], wait_ready: bool = True,
                 sessions: SessionStore | None = None, arm_routers: ArmRouterFactory | None = None,
                 **options) -> None:
        """arm_routers: split requests over the arms `load` returns as {arm name: Backend}."""
        self.event_loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.event_loop.run_forever, name="gateway-test", daemon=True)
        self.thread.start()
        options = {"host": "127.0.0.1", "port": 0, **options}
        self.gateway: Gateway = self.call(start_gateway(load, GatewayOptions(**options), sessions, arm_routers))
        if wait_ready:
            self.call(self.gateway.ready())

    @property
    def address(self) -> str:
        return self.gateway.address

    @property
    def engine(self):
        return self.gateway.loop.engine

    def call(self, coroutine: Coroutine, timeout: float = CALL_TIMEOUT):
        return asyncio.run_coroutine_threadsafe(coroutine, self.event_loop).result(timeout)

    def start_drain(self, grace: float) -> None:
        self.event_loop.call_soon_threadsafe(self.gateway.drain, grace)

    def wait_for(self, condition: Callable[[], bool], timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(0.02)
        return condition()

    def caches_empty(self) -> bool:
        engine = self.engine
        drafter_states = engine.drafter.runner.states if engine.drafter is not None else {}
        return not engine.sequences and not engine.verifier.runner.states and not drafter_states

    def stop(self) -> None:
        async def shutdown() -> None:
            await self.gateway.drain(0)

        try:
            self.call(shutdown())
        finally:
            self.event_loop.call_soon_threadsafe(self.event_loop.stop)
            self.thread.join(10)


def tiny_http_server(tiny_models, max_prompt_tokens: int) -> Iterator[ServerThread]:
    """A module fixture's body: a gateway over the tiny pair in this process, gRPC and HTTP on free ports."""
    target, draft, _ = tiny_models
    running = ServerThread(tiny_backend(target, draft), http_port=0,
                           limits=GatewayLimits(max_prompt_tokens=max_prompt_tokens))
    yield running
    running.stop()


def polled(read: Callable[[], T]) -> T:
    """read(), again after a 503 that says to retry (the shared store did not answer within its timeout: Redis on a
    loaded machine), as the SDK's own retries would; a test's client has none."""
    import openai

    for _ in range(2):
        try:
            return read()
        except openai.InternalServerError as exc:
            if exc.status_code != 503:
                raise
            time.sleep(0.5)
    return read()


def openai_sdk(server: ServerThread):
    """The openai SDK's client of a server's HTTP API (no retries: a test sees every answer)."""
    import openai

    return openai.OpenAI(base_url=f"{server.gateway.http_url}/v1", api_key="x", max_retries=0)


def user_message(text: str) -> dict:
    """A Responses API input item: a user message of one text part."""
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
