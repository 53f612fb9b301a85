"""One load level's settings, shared by the single-run CLI, the sweep and the driver."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loadtest.prompts import LENGTHS, SETS, Prompt, load_set
from loadtest.target import check_address, check_url

MODES = ("auto", "off")
BACKENDS = ("grpc", "openai")
TOKEN_COUNTS = ("token_ids", "logprobs", "chunks")  # the openai backend's tokens per SSE chunk (openai_backend.py)


@dataclass(slots=True)
class RunConfig:
    address: str  # HOST:PORT of the gRPC gateway ("" with the openai backend)
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
    priority: int = 0  # sent with every request: lower runs first (two runs at once: background and interactive)
    prompts: str = "mixed"  # a shipped set (SETS) or the path of a JSONL file (load_prompt_file)
    lengths: tuple[str, ...] = LENGTHS
    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False
    sessions: int = 0  # distinct session ids, requests assigned round robin; 0: one session per request
    connect_timeout: float = 10.0
    goodput: dict[str, float] = field(default_factory=dict)  # SLOs in seconds: ttft, tpot, e2el
    allow_remote: bool = False  # load tests target loopback addresses only unless this is set
    backend: str = "grpc"  # "grpc" (address) or "openai" (url: OpenAI's HTTP API, streamed over SSE)
    url: str = ""  # the OpenAI-compatible server's base URL, e.g. http://127.0.0.1:8000
    openai_token_counts: str = "token_ids"  # how the openai backend counts a chunk's tokens
    tls: bool = False  # grpc: a TLS channel (openai: an https URL says so)
    ca: str | None = None  # PEM CA that signed the server's certificate (default: the system's trust store)
    client_cert: str | None = None  # mutual TLS: this client's PEM certificate chain, with client_key
    client_key: str | None = None
    api_key: str | None = None  # sent as `authorization: Bearer <key>`; never written to results.json

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.openai_token_counts not in TOKEN_COUNTS:
            raise ValueError(f"openai_token_counts: must be one of {', '.join(TOKEN_COUNTS)}, "
                             f"got {self.openai_token_counts!r}")
        name, value, check = (("url", self.url, check_url) if self.backend == "openai"
                              else ("address", self.address, check_address))
        if not value:
            raise ValueError(f"{name}: the {self.backend} backend needs --{name}")
        try:
            check(value, self.allow_remote)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        if self.backend == "openai" and (self.tls or self.ca) and not self.url.startswith("https://"):
            raise ValueError(f"url: TLS (--tls, --ca) needs an https:// URL, got {self.url!r}")
        if self.backend == "grpc" and self.ca and not self.tls:
            raise ValueError("ca: a CA is for a TLS channel; add --tls")
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("client_cert: mutual TLS takes both --client-cert and --client-key")
        if self.client_cert is not None and not (self.tls or self.url.startswith("https://")):
            raise ValueError("client_cert: a client certificate is for a TLS channel (--tls, or an https:// URL)")
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
            # Seconds are finite: results.json and trace.jsonl are strict JSON, which has no infinity (no bound at
            # all is the default of duration and timeout: None).
            ("duration", self.duration is None or _positive(self.duration), "must be a positive number"),
            ("grace", math.isfinite(self.grace) and self.grace >= 0, "must be a finite number, not negative"),
            ("timeout", self.timeout is None or _positive(self.timeout), "must be a positive number"),
            ("warmup", self.warmup >= 0, "must not be negative"),
            ("speculation", self.speculation in MODES, f"must be one of {', '.join(MODES)}"),
            ("max_k", self.max_k is None or self.max_k >= 0, "must not be negative"),
            ("priority", 0 <= self.priority < 2**31, "must be from 0 to 2^31 - 1"),
            ("prompts", self.prompts in SETS or Path(self.prompts).is_file(),
             f"must be one of {', '.join(SETS)} or a JSONL file"),
            ("lengths", bool(self.lengths) and all(x in LENGTHS for x in self.lengths),
             f"must be among {', '.join(LENGTHS)}"),
            ("max_tokens", self.max_tokens >= 1, "must be at least 1"),
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0,
             "must be a finite number, not negative"),
            ("sessions", self.sessions >= 0, "must not be negative"),
            ("connect_timeout", _positive(self.connect_timeout), "must be a positive number"),
        ]
        for name, ok, message in checks:
            if not ok:
                raise ValueError(f"{name}: {message}, got {getattr(self, name)!r}")

    def load_prompts(self) -> list[Prompt]:
        """The prompts of `prompts`, a shipped set or a file, of the lengths in `lengths`."""
        try:
            if self.prompts in SETS:
                return load_set(self.prompts, self.lengths)
            return load_prompt_file(Path(self.prompts), self.lengths)
        except (OSError, ValueError) as exc:
            raise ValueError(f"prompts: {exc}") from None

    @property
    def target(self) -> str:
        """What the run talks to: the gRPC address or the HTTP base URL."""
        return self.url if self.backend == "openai" else self.address

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
        body["api_key"] = "<set>" if self.api_key else None  # a secret: results.json says only whether one was sent
        if body["rate"] is not None and math.isinf(body["rate"]):
            body["rate"] = "inf"  # JSON has no infinity
        return body


def _positive(value: float) -> bool:
    """A positive number of seconds: not 0, not negative, not NaN nor infinity."""
    return math.isfinite(value) and value > 0


def load_prompt_file(path: Path, lengths: tuple[str, ...] = LENGTHS) -> list[Prompt]:
    """A JSONL file of prompts, one a line: {"prompt": text} is sent as raw text, {"messages": [{"role", "content"},
    ...]} as chat. The shipped sets' rows (with "id", "kind" and "length") are read as they are; a row without a
    length is kept whatever `lengths` says, and one without an id is named by the file and its line."""
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path.name}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: not a JSON object")
        length = row.get("length", "")
        if length and length not in lengths:
            continue
        prompt_id = str(row.get("id") or f"{path.stem}-{number}")
        if messages := row.get("messages"):
            try:
                turns = tuple((str(m["role"]), str(m["content"])) for m in messages)
            except (KeyError, TypeError):
                raise ValueError(f"{where}: messages must be {{\"role\", \"content\"}} objects") from None
            prompts.append(Prompt(prompt_id, "chat", length, messages=turns))
        elif isinstance(row.get("prompt"), str) and row["prompt"]:
            prompts.append(Prompt(prompt_id, "code", length, text=row["prompt"]))
        else:
            raise ValueError(f"{where}: needs a \"prompt\" (text) or \"messages\" (chat) field")
    if not prompts:
        raise ValueError(f"{path} holds no prompts of length {', '.join(lengths)}")
    return prompts
