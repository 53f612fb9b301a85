"""What every load-tester backend shares (loadtest/backends.py, loadtest/openai_backend.py): the request a backend
streams (RequestSpec), the Final event that ends a stream, the two failures it raises (ServerUnreachable at open,
RequestFailed per request), the Backend interface, and how often a server still loading is polled.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from loadtest.config import RunConfig
from loadtest.prompts import Prompt

READY_POLL_SECONDS = 0.2  # how often a server still loading is asked whether it is ready


class ServerUnreachable(ConnectionError):
    pass


class RequestFailed(Exception):
    """One request failed; the message is "KIND: details"."""


@dataclass(slots=True, frozen=True)
class RequestSpec:
    prompt: Prompt
    request_id: str
    session_id: str
    max_tokens: int
    temperature: float
    seed: int | None
    ignore_eos: bool
    speculation: str
    max_k: int | None
    priority: int = 0


@dataclass(slots=True)
class Final:
    finish_reason: str = ""  # the proto's names (FINISH_REASON_LENGTH ...) from either backend
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    fallback_rounds: int = 0
    draft_failures: int = 0


class Backend:
    """open() checks the server answers and returns what it says about itself (results.json's "server")."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config

    async def open(self) -> dict:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    def stream(self, request: RequestSpec) -> AsyncIterator[int | Final]:
        raise NotImplementedError

    async def __aenter__(self) -> Backend:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()
