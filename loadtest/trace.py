"""What a run records per request, and the JSON-lines form it is saved in (DIR/trace.jsonl).

Times are seconds on the client's monotonic clock (time.perf_counter), relative to the benchmark's start: the moment
just before the first measured request is issued (warm-up requests are not part of the trace). Requests the run never
sent (its duration ran out first) have no record; RunTrace.planned says how many were asked for.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

OK = "ok"  # the stream ended with a Complete message
ERROR = "error"  # the server or the transport failed the request (a gRPC status other than OK)
CANCELLED = "cancelled"  # still in flight at duration + grace, cancelled by the client
NOT_SENT = "not_sent"  # never issued: the duration ran out first
STATUSES = (OK, ERROR, CANCELLED, NOT_SENT)


@dataclass(slots=True)
class RequestTrace:
    index: int
    prompt_id: str = ""
    status: str = NOT_SENT
    send: float | None = None  # when the request was issued
    end: float | None = None  # when the stream ended (the Complete arrived, or the error/cancel)
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried token ids
    chunk_tokens: list[int] = field(default_factory=list)  # token ids in each of those chunks
    prompt_tokens: int = 0  # usage.prompt_tokens from the Complete
    completion_tokens: int = 0  # usage.completion_tokens from the Complete
    finish_reason: str = ""
    rounds: int = 0  # SpeculationStats from the Complete
    drafted: int = 0
    accepted: int = 0
    fallback_rounds: int = 0
    draft_failures: int = 0
    error: str = ""  # the gRPC status code name and details when status is ERROR

    @property
    def output_tokens(self) -> int:
        """Tokens the client received (equal to usage.completion_tokens for a completed stream)."""
        return sum(self.chunk_tokens)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.send if self.chunk_times and self.send is not None else None

    @property
    def latency(self) -> float | None:
        return self.end - self.send if self.end is not None and self.send is not None else None


@dataclass(slots=True)
class RunTrace:
    requests: list[RequestTrace]  # the issued requests (a record with status not_sent may appear too)
    duration: float  # benchmark start to the end of the last measured request (or the cancel at duration + grace)
    config: dict = field(default_factory=dict)
    planned: int | None = None  # requests the run was asked for; those without a record were never sent

    def __post_init__(self) -> None:
        if self.planned is None:
            self.planned = len(self.requests)
        if self.planned < len(self.requests):
            raise ValueError(f"planned: {self.planned} is fewer than the {len(self.requests)} recorded requests")

    def by_status(self, status: str) -> list[RequestTrace]:
        return [r for r in self.requests if r.status == status]

    @property
    def not_sent(self) -> int:
        return self.planned - len(self.requests) + len(self.by_status(NOT_SENT))


def concatenate(runs: list[RunTrace]) -> RunTrace:
    """Several runs laid end to end on one clock (each shifted by the durations before it), as one run; the config
    is the last run's."""
    requests, offset = [], 0.0
    for run in runs:
        requests += [replace(request, chunk_times=[t + offset for t in request.chunk_times],
                             send=None if request.send is None else request.send + offset,
                             end=None if request.end is None else request.end + offset)
                     for request in run.requests]
        offset += run.duration
    return RunTrace(requests=requests, duration=offset, config=runs[-1].config,
                    planned=sum(run.planned for run in runs))


def save(trace: RunTrace, path: Path) -> None:
    """One header line {"duration", "planned", "config"}, then one line per recorded request."""
    with path.open("w") as handle:
        handle.write(json.dumps({"duration": trace.duration, "planned": trace.planned, "config": trace.config}) + "\n")
        for request in trace.requests:
            handle.write(json.dumps(asdict(request)) + "\n")


def load(path: Path) -> RunTrace:
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    header = json.loads(lines[0])
    requests = [RequestTrace(**json.loads(line)) for line in lines[1:]]
    return RunTrace(requests=requests, duration=header["duration"], config=header.get("config", {}),
                    planned=header.get("planned"))
