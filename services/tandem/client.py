"""Python clients for a tandem gateway: TandemClient (blocking) and AsyncTandemClient (asyncio).

    with TandemClient("127.0.0.1:50051") as client:
        for item in client.generate("def fib(n):", temperature=0, max_tokens=64):
            ...  # pb.Chunk messages (item.index says which of the n choices), then one pb.Complete per choice
        result = client.generate_result(chat=[{"role": "user", "content": "hi"}], n=2)
        result.text, result.choices[1].text, result.finish_reason, result.usage, result.speculation
        client.tokenize("def fib(n):"), client.model_info(), client.abort("my-request-id")

    TandemClient("gateway.example:443", tls=True, root_certificates="ca.pem", api_key=os.environ["TANDEM_API_KEY"])

Only grpcio, grpcio-health-checking and protobuf are needed (`pip install tandem`, no torch). Failures surface as
grpc.RpcError (see .code() and .details()); client-side misuse (two inputs, an unknown speculation mode, a
certificate without tls=True) raises tandem.errors.InvalidArgument before anything is sent. Values the server checks
(temperature ranges, max_tokens limits) are left to the server, so every client gets the same INVALID_ARGUMENT.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict, Unpack

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.errors import InvalidArgument
from tandem.response_format import wire_format
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc

try:  # Trace context travels only when OpenTelemetry is installed: an instrumented app has it, a bare client not.
    from tandem.telemetry.propagation import outgoing_metadata
except ImportError:  # pragma: no cover - exercised by the torch-free install check
    def outgoing_metadata() -> list[tuple[str, str]] | None:
        return None

Speculation = Literal["auto", "off"]
FinishReason = Literal["stop", "length", "abort", "tool_calls", "unspecified"]
ChatMessages = Iterable[tuple[str, str] | Mapping[str, str]]
PemSource = bytes | str | os.PathLike[str]  # PEM bytes, PEM text, or the path of a PEM file

SPECULATION_MODES = {"auto": pb.SpeculationOptions.MODE_AUTO, "off": pb.SpeculationOptions.MODE_OFF}
FINISH_REASONS: dict[int, FinishReason] = {
    pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls", pb.FINISH_REASON_UNSPECIFIED: "unspecified",
}
READINESS_SERVICE = "tandem.v1.GenerationService"


class GenerateOptions(TypedDict, total=False):
    """build_request's keywords, for the methods that pass them on (kept equal to its signature by a test)."""

    chat: ChatMessages | None
    token_ids: Iterable[int] | None
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    seed: int | None
    stop: str | Sequence[str]
    stop_token_ids: Iterable[int]
    ignore_eos: bool
    speculation: Speculation
    max_k: int | None
    session_id: str
    request_id: str
    n: int
    logprobs: int | None
    repetition_penalty: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    logit_bias: Mapping[int, float] | None
    tools: Iterable[Mapping[str, Any]] | None
    tool_choice: str
    response_format: Mapping[str, Any] | None


def build_request(prompt: str | None = None, *, chat: ChatMessages | None = None,
                  token_ids: Iterable[int] | None = None, max_tokens: int | None = None,
                  temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                  min_p: float | None = None, seed: int | None = None, stop: str | Sequence[str] = (),
                  stop_token_ids: Iterable[int] = (),
                  ignore_eos: bool = False, speculation: Speculation = "auto", max_k: int | None = None,
                  session_id: str = "", request_id: str = "", n: int = 1, logprobs: int | None = None,
                  repetition_penalty: float | None = None, presence_penalty: float | None = None,
                  frequency_penalty: float | None = None,
                  logit_bias: Mapping[int, float] | None = None, tools: Iterable[Mapping[str, Any]] | None = None,
                  tool_choice: str = "", response_format: Mapping[str, Any] | None = None) -> pb.GenerateRequest:
    """A GenerateRequest. Exactly one input: prompt (raw text), chat (the model's chat template is applied:
    {"role", "content"} mappings or (role, content) pairs) or token_ids. None leaves a sampling field unset (the
    server's default: temperature 1, top_p 1, top_k and min_p off, max_tokens 128, no penalties). n: choices for
    this prompt. logprobs: the number (0-20) of most likely alternatives each chunk reports beside the target's
    log-probability of every emitted token; None for none. repetition_penalty (> 1 discourages tokens already in
    the context), presence_penalty and frequency_penalty (-2 to 2, over the output) and logit_bias ({token id: -100
    to 100}) reshape the logits before sampling, as in vLLM and OpenAI. tools (a chat's, OpenAI-shaped) are shown
    to the model by its chat template, and the calls it makes come back parsed in the chunks' tool_calls;
    tool_choice: "" or "auto" (the model decides), "none" (not shown), "required" or "function:NAME" (the output
    begins with a call, of that tool if named). response_format: a structure the output follows, in OpenAI's shapes
    ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}, or
    {"type": "text"} for free text) or tandem's {"type": "regex", "regex": "..."} (the whole output matches it): the
    output is sampled from the target's distribution restricted to the format and ends at a whole match, or at
    max_tokens (finish reason "length"); the server refuses a format it cannot compile (INVALID_ARGUMENT)."""
    if sum(x is not None for x in (prompt, token_ids, chat)) != 1:
        raise InvalidArgument("input: pass exactly one of prompt, token_ids or chat")
    if speculation not in SPECULATION_MODES:
        raise InvalidArgument(f"speculation: must be one of {', '.join(SPECULATION_MODES)}, got {speculation!r}")
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p, "seed": seed,
                "max_tokens": max_tokens, "repetition_penalty": repetition_penalty,
                "presence_penalty": presence_penalty, "frequency_penalty": frequency_penalty,
                "logit_bias": dict(logit_bias) if logit_bias else None}
    request = pb.GenerateRequest(
        request_id=request_id, session_id=session_id,
        stop=[stop] if isinstance(stop, str) else list(stop),  # a lone string is one stop, not its characters
        stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
        sampling=pb.SamplingParams(**{k: v for k, v in sampling.items() if v is not None},
                                   response_format=wire_format(response_format)),
        speculation=pb.SpeculationOptions(mode=SPECULATION_MODES[speculation], max_k=max_k),
        n=n, logprobs=logprobs,
    )
    if prompt is not None:
        request.prompt = prompt
    elif token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    else:
        request.chat.CopyFrom(_chat(chat, tools or (), tool_choice))
    if tools and chat is None:
        raise InvalidArgument("tools: only a chat can offer tools")
    return request


def _chat(messages: ChatMessages, tools: Iterable[Mapping[str, Any]] = (), tool_choice: str = "") -> pb.Chat:
    """Messages are (role, content) pairs or OpenAI-shaped mappings (an assistant's `tool_calls`, a tool turn's
    `tool_call_id` and `name`); tools are OpenAI-shaped ({"type": "function", "function": {...}}) or the function
    mappings alone."""
    chat = pb.Chat(tool_choice=tool_choice)
    for message in messages:
        if not isinstance(message, Mapping):
            role, content = message
            chat.messages.add(role=role, content=content)
            continue
        calls = [pb.ToolCall(id=call.get("id", ""), name=call["function"]["name"],
                             arguments_json=_json_text(call["function"].get("arguments", {})))
                 for call in message.get("tool_calls") or ()]
        chat.messages.add(role=message["role"], content=message.get("content") or "", tool_calls=calls,
                          tool_call_id=message.get("tool_call_id", ""), name=message.get("name", ""))
    for tool in tools:
        function = tool.get("function", tool)
        chat.tools.add(name=function["name"], description=function.get("description", ""),
                       parameters_json=_json_text(function.get("parameters", {})))
    return chat


def _json_text(value: Any) -> str:
    """JSON text as the wire carries it: a string is taken as JSON text already."""
    return value if isinstance(value, str) else json.dumps(value)


def build_tokenize_request(prompt: str | None = None, *, chat: ChatMessages | None = None,
                           tools: Iterable[Mapping[str, Any]] = ()) -> pb.TokenizeRequest:
    if (prompt is None) == (chat is None):
        raise InvalidArgument("input: pass exactly one of prompt or chat")
    return pb.TokenizeRequest(prompt=prompt) if prompt is not None else pb.TokenizeRequest(chat=_chat(chat, tools))


# --- results ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True, slots=True)
class SpeculationStats:
    """The server's per-choice SpeculationStats (see protos/tandem/v1/generation.proto)."""

    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0
    fallback_rounds: int = 0
    acceptance_per_position: tuple[float, ...] = ()
    draft_failures: int = 0

    @classmethod
    def from_proto(cls, stats: pb.SpeculationStats) -> SpeculationStats:
        return cls(stats.rounds, stats.drafted_tokens, stats.accepted_tokens, stats.acceptance_rate,
                   stats.mean_accepted_length, stats.fallback_rounds, tuple(stats.acceptance_per_position),
                   stats.draft_failures)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first

    @classmethod
    def from_proto(cls, item: pb.TokenLogprob) -> TokenLogprob:
        return cls(item.token_id, item.logprob, tuple((t.token_id, t.logprob) for t in item.top))


@dataclass(slots=True)
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # None unless the request set logprobs
    tool_calls: list[pb.ToolCall] = field(default_factory=list)  # the calls the model made (a chat offered tools)
    finish_reason: FinishReason = "unspecified"
    usage: Usage = field(default_factory=Usage)
    speculation: SpeculationStats = field(default_factory=SpeculationStats)


@dataclass(slots=True)
class GenerateResult:
    """A whole Generate stream: one Choice per requested choice, in index order. text, token_ids, finish_reason and
    speculation are the first choice's (all there is with n = 1); usage counts the prompt once and every choice's
    completion tokens (as OpenAI's usage does)."""

    request_id: str
    choices: list[Choice]

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> FinishReason:
        return self.choices[0].finish_reason

    @property
    def speculation(self) -> SpeculationStats:
        return self.choices[0].speculation

    @property
    def usage(self) -> Usage:
        return Usage(self.choices[0].usage.prompt_tokens, sum(c.usage.completion_tokens for c in self.choices))


class Collector:
    """Assembles a GenerateResult from streamed items; feed it while streaming (as `tandem generate` does, printing
    text as it comes) or let generate_result do it."""

    def __init__(self, logprobs: bool = False) -> None:
        self.logprobs = logprobs
        self.choices: dict[int, Choice] = {}
        self.completes: dict[int, pb.Complete] = {}
        self.request_id = ""

    def _choice(self, index: int) -> Choice:
        if index not in self.choices:
            self.choices[index] = Choice(index, logprobs=[] if self.logprobs else None)
        return self.choices[index]

    def add(self, item: pb.Chunk | pb.Complete) -> None:
        choice = self._choice(item.index)
        if isinstance(item, pb.Chunk):
            choice.text += item.text
            choice.token_ids.extend(item.token_ids)
            choice.tool_calls.extend(item.tool_calls)
            if choice.logprobs is not None:
                choice.logprobs.extend(TokenLogprob.from_proto(x) for x in item.logprobs)
            return
        self.completes[item.index] = item
        self.request_id = self.request_id or item.request_id
        choice.finish_reason = FINISH_REASONS.get(item.finish_reason, "unspecified")
        choice.usage = Usage(item.usage.prompt_tokens, item.usage.completion_tokens)
        choice.speculation = SpeculationStats.from_proto(item.speculation)

    def result(self) -> GenerateResult:
        if not self.completes or set(self.completes) != set(self.choices):
            missing = sorted(set(self.choices) - set(self.completes)) or [0]
            raise RuntimeError(f"the stream ended without a Complete message for choice {missing[0]}")
        return GenerateResult(self.request_id, [self.choices[i] for i in sorted(self.choices)])


def _unwrap(response: pb.GenerateResponse) -> pb.Chunk | pb.Complete:
    return response.chunk if response.WhichOneof("kind") == "chunk" else response.complete


# --- channels -----------------------------------------------------------------------------------------------------


def _pem(source: PemSource | None) -> bytes | None:
    if source is None or isinstance(source, bytes):
        return source
    text = os.fspath(source)
    if text.lstrip().startswith("-----BEGIN"):
        return text.encode()
    with open(text, "rb") as handle:
        return handle.read()


@dataclass(frozen=True, slots=True)
class ChannelSettings:
    """Where and how to connect: shared by the blocking and the asyncio client."""

    target: str
    tls: bool = False
    root_certificates: PemSource | None = None  # None with tls: the system's trust store (grpc's bundled roots)
    private_key: PemSource | None = None  # with certificate_chain: a client certificate (mutual TLS)
    certificate_chain: PemSource | None = None
    api_key: str | None = None  # sent as `authorization: Bearer <key>` on every call
    options: Sequence[tuple[str, Any]] = ()  # grpc channel options, e.g. ("grpc.ssl_target_name_override", host)

    def __post_init__(self) -> None:
        if not self.tls and any(x is not None for x in (self.root_certificates, self.private_key,
                                                        self.certificate_chain)):
            raise InvalidArgument("tls: certificates were given for a plaintext channel; pass tls=True")
        if (self.private_key is None) != (self.certificate_chain is None):
            raise InvalidArgument("private_key: a client certificate needs both private_key and certificate_chain")
        if self.api_key is not None and (not self.api_key or any(c in self.api_key for c in "\r\n")):
            raise InvalidArgument("api_key: must be a non-empty single-line string")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=_pem(self.root_certificates),
                                            private_key=_pem(self.private_key),
                                            certificate_chain=_pem(self.certificate_chain))

    def metadata(self) -> list[tuple[str, str]] | None:
        """Per-call metadata: the API key and the current trace context. The key goes as plain metadata rather than
        grpc call credentials, which grpc sends over TLS only: a gateway behind a TLS-terminating proxy or mesh is
        reached in plaintext and still wants the key."""
        metadata = list(outgoing_metadata() or ())
        if self.api_key is not None:
            metadata.append(("authorization", f"Bearer {self.api_key}"))
        return metadata or None


class TandemClient:
    def __init__(self, target: str = "127.0.0.1:50051", *, timeout: float | None = None, tls: bool = False,
                 root_certificates: PemSource | None = None, private_key: PemSource | None = None,
                 certificate_chain: PemSource | None = None, api_key: str | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        """target: HOST:PORT (or any grpc target). timeout: default deadline in seconds for each call (None: no
        deadline). tls: a secure channel, verified against root_certificates (PEM bytes, text or a file path; None:
        grpc's bundled roots); private_key + certificate_chain: mutual TLS. api_key: `authorization: Bearer` on
        every call."""
        self.settings = ChannelSettings(target, tls, root_certificates, private_key, certificate_chain, api_key,
                                        tuple(options))
        self.address = target
        self.timeout = timeout
        self.channel = (grpc.secure_channel(target, self.settings.credentials(), options=self.settings.options)
                        if tls else grpc.insecure_channel(target, options=self.settings.options))
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **options: Unpack[GenerateOptions]) -> Iterator[pb.Chunk | pb.Complete]:
        """Stream Chunk messages and, for each of the n choices, a Complete (Chunk.index and Complete.index say
        which choice). Closing the iterator early cancels the request. The request is built (and checked) at once,
        before the first next(); the current OpenTelemetry span, if any, travels as W3C trace context."""
        request = build_request(prompt, **options)
        return self._stream(request, timeout)

    def _stream(self, request: pb.GenerateRequest, timeout: float | None) -> Iterator[pb.Chunk | pb.Complete]:
        call = self.stub.Generate(request, timeout=self._timeout(timeout), metadata=self.settings.metadata())
        try:
            for response in call:
                yield _unwrap(response)
        finally:
            call.cancel()

    def generate_result(self, prompt: str | None = None, *, timeout: float | None = None,
                        **options: Unpack[GenerateOptions]) -> GenerateResult:
        """The whole stream collected: text, token ids, finish reason, usage and speculation stats per choice."""
        collector = Collector(logprobs=options.get("logprobs") is not None)
        for item in self.generate(prompt, timeout=timeout, **options):
            collector.add(item)
        return collector.result()

    def generate_text(self, prompt: str | None = None, *, timeout: float | None = None,
                      **options: Unpack[GenerateOptions]) -> tuple[str, pb.Complete]:
        """(text, Complete) of the first choice: the older form of generate_result."""
        return _first_choice(self.generate(prompt, timeout=timeout, **options))

    def tokenize(self, prompt: str | None = None, *, chat: ChatMessages | None = None,
                 tools: Iterable[Mapping[str, Any]] = (), timeout: float | None = None) -> list[int]:
        """The target tokenizer's ids for a raw prompt, or for a chat with the chat template applied (and its
        tools shown, as generate shows them)."""
        response = self.stub.Tokenize(build_tokenize_request(prompt, chat=chat, tools=tools),
                                      timeout=self._timeout(timeout), metadata=self.settings.metadata())
        return list(response.token_ids)

    def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Stop a running request by id; False when the gateway knows no such running request."""
        return self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self._timeout(timeout),
                               metadata=self.settings.metadata()).found

    def model_info(self, *, timeout: float | None = None) -> pb.GetModelInfoResponse:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._timeout(timeout),
                                      metadata=self.settings.metadata())

    def health_status(self, service: str = "", *, timeout: float | None = None) -> int:
        """grpc.health.v1 status of `service` ("" liveness, READINESS_SERVICE readiness)."""
        request = health_pb2.HealthCheckRequest(service=service)
        return self.health.Check(request, timeout=self._timeout(timeout), metadata=self.settings.metadata()).status

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> TandemClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class AsyncTandemClient:
    """The asyncio twin of TandemClient (same constructor and methods, awaitable; generate is an async iterator).
    Make it inside the event loop that uses it."""

    def __init__(self, target: str = "127.0.0.1:50051", *, timeout: float | None = None, tls: bool = False,
                 root_certificates: PemSource | None = None, private_key: PemSource | None = None,
                 certificate_chain: PemSource | None = None, api_key: str | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        self.settings = ChannelSettings(target, tls, root_certificates, private_key, certificate_chain, api_key,
                                        tuple(options))
        self.address = target
        self.timeout = timeout
        self.channel = (grpc.aio.secure_channel(target, self.settings.credentials(), options=self.settings.options)
                        if tls else grpc.aio.insecure_channel(target, options=self.settings.options))
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **options: Unpack[GenerateOptions]) -> AsyncIterator[pb.Chunk | pb.Complete]:
        """As TandemClient.generate; leaving the `async for` early (or cancelling its task) cancels the request."""
        request = build_request(prompt, **options)
        return self._stream(request, timeout)

    async def _stream(self, request: pb.GenerateRequest,
                      timeout: float | None) -> AsyncIterator[pb.Chunk | pb.Complete]:
        call = self.stub.Generate(request, timeout=self._timeout(timeout), metadata=self.settings.metadata())
        try:
            async for response in call:
                yield _unwrap(response)
        finally:
            call.cancel()

    async def generate_result(self, prompt: str | None = None, *, timeout: float | None = None,
                              **options: Unpack[GenerateOptions]) -> GenerateResult:
        collector = Collector(logprobs=options.get("logprobs") is not None)
        async for item in self.generate(prompt, timeout=timeout, **options):
            collector.add(item)
        return collector.result()

    async def generate_text(self, prompt: str | None = None, *, timeout: float | None = None,
                            **options: Unpack[GenerateOptions]) -> tuple[str, pb.Complete]:
        return _first_choice([item async for item in self.generate(prompt, timeout=timeout, **options)])

    async def tokenize(self, prompt: str | None = None, *, chat: ChatMessages | None = None,
                       tools: Iterable[Mapping[str, Any]] = (), timeout: float | None = None) -> list[int]:
        response = await self.stub.Tokenize(build_tokenize_request(prompt, chat=chat, tools=tools),
                                            timeout=self._timeout(timeout), metadata=self.settings.metadata())
        return list(response.token_ids)

    async def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        response = await self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self._timeout(timeout),
                                         metadata=self.settings.metadata())
        return response.found

    async def model_info(self, *, timeout: float | None = None) -> pb.GetModelInfoResponse:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._timeout(timeout),
                                            metadata=self.settings.metadata())

    async def health_status(self, service: str = "", *, timeout: float | None = None) -> int:
        request = health_pb2.HealthCheckRequest(service=service)
        response = await self.health.Check(request, timeout=self._timeout(timeout), metadata=self.settings.metadata())
        return response.status

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncTandemClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()


def _first_choice(items: Iterable[pb.Chunk | pb.Complete]) -> tuple[str, pb.Complete]:
    parts: list[str] = []
    complete = None
    for item in items:
        if item.index != 0:
            continue
        if isinstance(item, pb.Chunk):
            parts.append(item.text)
        else:
            complete = item
    if complete is None:
        raise RuntimeError("the stream ended without a Complete message")
    return "".join(parts), complete
