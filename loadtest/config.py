"""One load level's settings, shared by the single-run CLI, the sweep and the driver."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from loadtest.prompts import LENGTHS, SETS
from loadtest.target import check_address

MODES = ("auto", "off")


@dataclass(slots=True)
class RunConfig:
    address: str
    requests: int  # measured requests (warm-up not included)
    rate: float | None = None  # requests per second (math.inf: all at once); None in concurrency mode
    concurrency: int | None = None  # fixed concurrency: this many workers, each sending back to back
    burstiness: float = 1.0  # gamma shape of the inter-arrival gaps; 1.0 is Poisson
    max_concurrency: int | None = None  # rate mode: at most this many in flight (later arrivals wait)
    seed: int = 0
    duration: float | None = None  # stop issuing after this many seconds
    grace: float = 10.0  # then cancel what is still in flight this many seconds later
    timeout: float | None = 600.0  # per-request gRPC deadline
    warmup: int = 1  # requests sent (one at a time) before the benchmark starts, excluded from the metrics
    speculation: str = "auto"
    max_k: int | None = None
    prompts: str = "mixed"
    lengths: tuple[str, ...] = LENGTHS
    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False
    sessions: int = 0  # distinct session ids, requests assigned round robin; 0: one session per request
    connect_timeout: float = 10.0
    goodput: dict[str, float] = field(default_factory=dict)  # SLOs in seconds: ttft, tpot, e2el
    allow_remote: bool = False  # load tests target loopback addresses only unless this is set

    def __post_init__(self) -> None:
        try:
            check_address(self.address, self.allow_remote)
        except ValueError as exc:
            raise ValueError(f"address: {exc}") from None
        if self.rate is not None and self.concurrency is not None:
            raise ValueError("rate: give either a rate or a concurrency, not both")
        if self.rate is None and self.concurrency is None:
            self.rate = math.inf
        checks = [
            ("requests", self.requests >= 1, "must be at least 1"),
            ("rate", self.rate is None or self.rate > 0, "must be positive"),
            ("concurrency", self.concurrency is None or self.concurrency >= 1, "must be at least 1"),
            ("max_concurrency", self.max_concurrency is None or self.max_concurrency >= 1, "must be at least 1"),
            ("burstiness", self.burstiness > 0 and math.isfinite(self.burstiness), "must be a positive number"),
            ("duration", self.duration is None or self.duration > 0, "must be positive"),
            ("grace", self.grace >= 0, "must not be negative"),
            ("timeout", self.timeout is None or self.timeout > 0, "must be positive"),
            ("warmup", self.warmup >= 0, "must not be negative"),
            ("speculation", self.speculation in MODES, f"must be one of {', '.join(MODES)}"),
            ("max_k", self.max_k is None or self.max_k >= 0, "must not be negative"),
            ("prompts", self.prompts in SETS, f"must be one of {', '.join(SETS)}"),
            ("lengths", bool(self.lengths) and all(x in LENGTHS for x in self.lengths),
             f"must be among {', '.join(LENGTHS)}"),
            ("max_tokens", self.max_tokens >= 1, "must be at least 1"),
            ("temperature", self.temperature >= 0, "must not be negative"),
            ("sessions", self.sessions >= 0, "must not be negative"),
            ("connect_timeout", self.connect_timeout > 0, "must be positive"),
        ]
        for name, ok, message in checks:
            if not ok:
                raise ValueError(f"{name}: {message}, got {getattr(self, name)!r}")

    @property
    def load(self) -> str:
        """A label for the load level: 'rate=2', 'rate=inf' or 'concurrency=4'."""
        if self.concurrency is not None:
            return f"concurrency={self.concurrency}"
        return f"rate={'inf' if math.isinf(self.rate) else f'{self.rate:g}'}"

    def to_json(self) -> dict:
        body = asdict(self)
        body["lengths"] = list(self.lengths)
        body["load"] = self.load
        if body["rate"] is not None and math.isinf(body["rate"]):
            body["rate"] = "inf"  # JSON has no infinity
        return body
