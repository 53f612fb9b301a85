"""The asyncio driver: sends one load level's requests over grpc.aio and records a RunTrace.

Rate mode issues request i at the i-th offset of the arrival process (an absolute schedule, so late wake-ups do not
accumulate); concurrency mode runs C workers that each send their next request as soon as the last one ends.
Bounds: `requests` in all; with `duration`, nothing new is issued after `duration` seconds and whatever is still in
flight at `duration + grace` is cancelled (the RPC is cancelled on the wire, so the server frees its caches) and
recorded as cancelled; requests never issued leave no record and count as not_sent. With max_concurrency, a request
that arrives while all slots are busy waits for one, and its send time (the start of its TTFT) is when it gets it, as
in vLLM.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid

import grpc
from google.protobuf.json_format import MessageToDict

from loadtest.arrivals import ArrivalProcess
from loadtest.config import RunConfig
from loadtest.prompts import Prompt, load_set, schedule
from loadtest.trace import CANCELLED, ERROR, OK, RequestTrace, RunTrace
from tandem.client import build_request
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc

IN_FLIGHT = "in_flight"
CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0)]  # loopback targets: never route through a proxy from the env


class ServerUnreachable(ConnectionError):
    pass


class WarmupFailed(RuntimeError):
    pass


class Driver:
    def __init__(self, config: RunConfig, prompts: list[Prompt] | None = None) -> None:
        self.config = config
        self.prompts = schedule(prompts or load_set(config.prompts, config.lengths), config.requests + config.warmup,
                                config.seed)
        self.run_id = f"lt-{config.speculation}-{uuid.uuid4().hex[:8]}"
        self.start = 0.0
        self.server: dict = {}

    def now(self) -> float:
        return time.perf_counter() - self.start

    def request(self, index: int, prompt: Prompt, tag: str = "") -> pb.GenerateRequest:
        config = self.config
        session = index % config.sessions if config.sessions else index
        sampling = {"temperature": config.temperature, "max_tokens": config.max_tokens}
        if config.temperature > 0:
            sampling["seed"] = config.seed * 1_000_003 + index
        return build_request(**prompt.request_input(), request_id=f"{self.run_id}{tag}-{index}",
                             session_id=f"{self.run_id}{tag}-s{session}", ignore_eos=config.ignore_eos,
                             speculation=config.speculation, max_k=config.max_k, **sampling)

    async def send(self, stub: generation_pb2_grpc.GenerationServiceStub, request: pb.GenerateRequest,
                   trace: RequestTrace) -> RequestTrace:
        """One streamed request, recorded into trace; never raises except CancelledError."""
        trace.status, trace.send = IN_FLIGHT, self.now()
        call = stub.Generate(request, timeout=self.config.timeout)
        try:
            async for response in call:
                if response.WhichOneof("kind") == "chunk":
                    if tokens := len(response.chunk.token_ids):
                        trace.chunk_times.append(self.now())
                        trace.chunk_tokens.append(tokens)
                else:
                    trace.end = self.now()
                    _record_complete(trace, response.complete)
            if trace.status != OK:
                trace.end, trace.status, trace.error = self.now(), ERROR, "INCOMPLETE: no Complete message"
        except grpc.aio.AioRpcError as exc:
            trace.end, trace.status, trace.error = self.now(), ERROR, f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            call.cancel()
            trace.end, trace.status = self.now(), CANCELLED
            raise
        return trace

    async def warm_up(self, stub: generation_pb2_grpc.GenerationServiceStub) -> None:
        for index in range(self.config.warmup):
            trace = await self.send(stub, self.request(index, self.prompts[index], "-warmup"), RequestTrace(index))
            if trace.status != OK:
                raise WarmupFailed(trace.error)

    async def run(self) -> RunTrace:
        config = self.config
        async with grpc.aio.insecure_channel(config.address, options=CHANNEL_OPTIONS) as channel:
            try:
                await asyncio.wait_for(channel.channel_ready(), config.connect_timeout)
            except TimeoutError:
                raise ServerUnreachable(f"no server answered at {config.address} within "
                                        f"{config.connect_timeout:g} s") from None
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            try:
                info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=config.connect_timeout)
                self.server = MessageToDict(info, preserving_proto_field_name=True)
            except grpc.aio.AioRpcError as exc:
                self.server = {"error": f"{exc.code().name}: {exc.details()}"}
            await self.warm_up(stub)
            return await self.measure(stub)

    async def measure(self, stub: generation_pb2_grpc.GenerationServiceStub) -> RunTrace:
        config = self.config
        measured = self.prompts[config.warmup:]
        # Requests and their records are made when sent, so a large --requests with a short --duration starts at once.
        traces: list[RequestTrace | None] = [None] * len(measured)
        self.start = time.perf_counter()
        issuing_ends = config.duration if config.duration is not None else float("inf")
        hard_end = issuing_ends + config.grace

        async def one(index: int) -> None:
            if self.now() < issuing_ends:
                request = self.request(index, measured[index])
                traces[index] = RequestTrace(index, prompt_id=measured[index].id)
                await self.send(stub, request, traces[index])

        if config.concurrency is not None:
            counter = itertools.count()

            async def worker() -> None:
                while (index := next(counter)) < len(measured) and self.now() < issuing_ends:
                    await one(index)

            tasks = [asyncio.create_task(worker()) for _ in range(config.concurrency)]
        else:
            tasks = await self.issue(one, len(measured), issuing_ends)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, hard_end - self.now())
                                            if config.duration is not None else None)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        duration = self.now()
        records = [trace for trace in traces if trace is not None]  # requests never sent leave no record
        for trace in records:
            if trace.status == IN_FLIGHT:  # defensive: send() marks a cancelled request before re-raising
                trace.status, trace.end = CANCELLED, trace.end or duration
        return RunTrace(requests=records, duration=duration, planned=len(measured),
                        config=config.to_json() | {"run_id": self.run_id, "server": self.server})

    async def issue(self, one, count: int, issuing_ends: float) -> list[asyncio.Task]:
        """Rate mode: start request i at its arrival offset, behind a semaphore when max_concurrency is set."""
        config = self.config
        offsets = ArrivalProcess(config.rate, config.burstiness, config.seed).offsets(count)
        slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None

        async def gated(index: int) -> None:
            async with slots:
                await one(index)

        tasks: list[asyncio.Task] = []
        for index, offset in enumerate(offsets):
            if offset >= issuing_ends:
                break
            if (delay := offset - self.now()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(gated(index) if slots else one(index)))
        return tasks


def _record_complete(trace: RequestTrace, complete: pb.Complete) -> None:
    stats = complete.speculation
    trace.status = OK
    trace.prompt_tokens = complete.usage.prompt_tokens
    trace.completion_tokens = complete.usage.completion_tokens
    trace.finish_reason = pb.FinishReason.Name(complete.finish_reason)
    trace.rounds, trace.drafted, trace.accepted = stats.rounds, stats.drafted_tokens, stats.accepted_tokens
    trace.fallback_rounds, trace.draft_failures = stats.fallback_rounds, stats.draft_failures


async def run_level(config: RunConfig, prompts: list[Prompt] | None = None) -> RunTrace:
    return await Driver(config, prompts).run()

