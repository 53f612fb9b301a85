"""The load tester's OpenAI HTTP backend: one request POSTed to /v1/completions or /v1/chat/completions with
`stream: true`, its SSE chunks turned into the events loadtest/backend_base.py defines (tokens per chunk, then a
Final with usage and tandem's speculation stats); failures as RequestFailed("HTTP_<status>: ...") and the like.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import AsyncIterator

from loadtest.backend_base import READY_POLL_SECONDS, Backend, Final, RequestFailed, RequestSpec, ServerUnreachable
from loadtest.config import RunConfig


class OpenAIBackend(Backend):
    """POST /v1/completions (code prompts: raw text) or /v1/chat/completions (chat prompts: the server applies the
    chat template), `stream: true` with `stream_options.include_usage`, tandem's extra fields (ignore_eos,
    speculation, max_k, priority, session_id, request_id) at the top level of the body.

    Tokens per SSE chunk: OpenAI's chunks carry text, not token ids, and a speculative round's chunk holds several
    tokens. With `openai_token_counts="token_ids"` (the default) each request sets vLLM's `return_token_ids: true`
    and a chunk's tokens are its choice's `token_ids`: exact, the counts the gRPC path reads from Chunk.token_ids, and
    no work on the server the gRPC path does not do. "logprobs" asks for logprobs with no alternatives instead
    (`logprobs: 0`; chat: `logprobs: true, top_logprobs: 0`) and counts a chunk's logprob entries: exact too, for
    servers without return_token_ids, at the cost of the server computing one log-softmax per emitted token.
    "chunks" asks for nothing and counts one token per chunk with text (vLLM's bench assumption), so ITL is per chunk
    and the output token total is a lower bound under speculation."""

    def __init__(self, config: RunConfig) -> None:
        import httpx

        super().__init__(config)
        self.httpx = httpx
        self.base = config.url.rstrip("/")
        self.model = ""
        # No pool cap (a load level decides concurrency, not the client); trust_env off: never a proxy for loopback.
        # verify: a private CA's file when given (httpx's default, certifi's bundle, knows no private CA).
        verify = ssl.create_default_context(cafile=config.ca) if config.ca or config.client_cert else True
        if config.client_cert:  # mutual TLS
            verify.load_cert_chain(config.client_cert, config.client_key)
        headers = {"authorization": f"Bearer {config.api_key}"} if config.api_key else None
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=config.connect_timeout),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                                        trust_env=False, verify=verify, headers=headers)

    async def open(self) -> dict:
        """GET /v1/models, again while the server refuses (not listening yet) or is still loading its models (503),
        up to the connect timeout: `tandem serve ... & python -m loadtest --backend openai ...` waits for it."""
        config = self.config
        deadline, answered = time.monotonic() + config.connect_timeout, False
        while True:
            try:
                response = await self.client.get(f"{self.base}/v1/models",
                                                 timeout=max(0.1, deadline - time.monotonic()))
                answered = True
                if response.status_code != 503:
                    break
            except self.httpx.TransportError as exc:
                if time.monotonic() >= deadline:
                    raise ServerUnreachable(f"no server answered at {config.url} within {config.connect_timeout:g} "
                                            f"s ({type(exc).__name__})") from None
            if time.monotonic() >= deadline:
                if answered:
                    raise ServerUnreachable(f"the server at {config.url} answered but was not ready within "
                                            f"{config.connect_timeout:g} s ({_error_message(response.content)})")
                raise ServerUnreachable(f"no server answered at {config.url} within {config.connect_timeout:g} s")
            await asyncio.sleep(min(READY_POLL_SECONDS, max(0.0, deadline - time.monotonic())))
        if response.status_code != 200:
            return {"error": f"HTTP_{response.status_code}: {response.text[:200]}"}
        models = [m["id"] for m in response.json().get("data", [])]
        self.model = models[0] if models else ""
        return {"target_model": self.model, "models": models, "url": config.url}

    async def close(self) -> None:
        await self.client.aclose()

    def body(self, request: RequestSpec) -> tuple[str, dict]:
        config = self.config
        counts = config.openai_token_counts
        body: dict = {"model": self.model, "max_tokens": request.max_tokens, "temperature": request.temperature,
                      "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": request.ignore_eos,
                      "speculation": request.speculation, "session_id": request.session_id,
                      "request_id": request.request_id}
        if request.seed is not None:
            body["seed"] = request.seed
        if request.max_k is not None:
            body["max_k"] = request.max_k
        if request.priority:
            body["priority"] = request.priority
        if counts == "token_ids":
            body["return_token_ids"] = True
        if request.prompt.kind == "chat":
            body["messages"] = [{"role": role, "content": content} for role, content in request.prompt.messages]
            if counts == "logprobs":
                body |= {"logprobs": True, "top_logprobs": 0}
            return "/v1/chat/completions", body
        body["prompt"] = request.prompt.text
        if counts == "logprobs":
            body["logprobs"] = 0
        return "/v1/completions", body

    async def stream(self, request: RequestSpec) -> AsyncIterator[int | Final]:
        path, body = self.body(request)
        counts = self.config.openai_token_counts
        final: Final | None = None
        try:
            # A whole-request deadline, as the gRPC path's (httpx's timeouts are per read).
            async with asyncio.timeout(self.config.timeout), \
                    self.client.stream("POST", self.base + path, json=body) as response:
                if response.status_code != 200:
                    raise RequestFailed(_http_error(response.status_code, await response.aread()))
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, event names
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:  # an error after the stream began
                        error = chunk["error"] or {}
                        raise RequestFailed(f"{error.get('type') or 'error'}: {error.get('message', '')}")
                    for choice in chunk.get("choices") or ():
                        if choice.get("finish_reason") is not None:
                            final = _final(choice)
                            yield final
                        elif tokens := _tokens(choice, counts):
                            yield tokens
                    if (usage := chunk.get("usage")) and final is not None:
                        final.prompt_tokens = usage.get("prompt_tokens", 0)
                        final.completion_tokens = usage.get("completion_tokens", 0)
        except TimeoutError:
            raise RequestFailed(f"DEADLINE_EXCEEDED: no end within {self.config.timeout:g} s") from None
        except self.httpx.TransportError as exc:
            raise RequestFailed(f"{type(exc).__name__}: {exc}") from None


def _tokens(choice: dict, counts: str) -> int:
    """Tokens in one streamed choice: its `token_ids`, its logprob entries (completions: `tokens`; chat: `content`),
    or one per chunk with text, as `counts` (RunConfig.openai_token_counts) says."""
    if counts == "token_ids":
        return len(choice.get("token_ids") or ())
    if counts == "logprobs":
        logprobs = choice.get("logprobs") or {}
        entries = logprobs.get("tokens") if "tokens" in logprobs else logprobs.get("content")
        return len(entries or ())
    text = choice["delta"].get("content") if "delta" in choice else choice.get("text")
    return 1 if text else 0


def _final(choice: dict) -> Final:
    """The finish chunk: tandem puts the choice's speculation stats under "tandem" (absent on other servers)."""
    stats = (choice.get("tandem") or {}).get("speculation") or {}
    return Final(finish_reason=f"FINISH_REASON_{choice['finish_reason'].upper()}",
                 rounds=stats.get("rounds", 0), drafted=stats.get("drafted", 0), accepted=stats.get("accepted", 0),
                 fallback_rounds=stats.get("fallback_rounds", 0), draft_failures=stats.get("draft_failures", 0))


def _http_error(status: int, body: bytes) -> str:
    return f"HTTP_{status}: {_error_message(body)}"


def _error_message(body: bytes) -> str:
    """An OpenAI error body's message, else the body's start."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace")
