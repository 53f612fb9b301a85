"""What a serving loop (gateway.loop, gateway.lanes) and the gateway's reports drive and read of an engine: the
speculative engine's public face as a protocol. core.engine.SpeculativeEngine is its implementation; the gateway
names this type, never the class, so a test may drive the serving layers with any object that has these members."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tandem.core.config import SamplingParams
from tandem.core.costs import CostModel
from tandem.core.policy import PolicyState, SharedPrior
from tandem.core.protocol import Drafter, Verifier
from tandem.core.requests import GenerationResult, Sequence, StepOutput


class ServingEngine(Protocol):
    verifier: Verifier  # the target side (its KV usage, replicas, reachability)
    drafter: Drafter | None  # the draft side, None where it never speculates
    costs: CostModel  # measured forward costs (GetModelInfo reports them)
    prior: SharedPrior  # the deployment's acceptance prior
    eos_token_ids: frozenset[int]
    decode: Callable[[list[int]], str] | None
    step_tokens: int  # tokens the running step's target forward computes at most (the stall watchdog's allowance)

    @property
    def speculating(self) -> bool: ...

    @property
    def max_batch(self) -> int:
        """Sequences one step runs; requests beyond it wait in the queue."""
        ...

    @property
    def preemptions(self) -> dict[str, int]: ...

    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
                    policy_state: PolicyState | None = None, max_k: int | None = None, session_id: str = "",
                    cache_scope: str = "", priority: int = 0, prediction: list[int] | None = None) -> str: ...

    def sequence(self, request_id: str) -> Sequence:
        """An added request's sequence, while it runs."""
        ...

    def abort(self, request_id: str) -> None: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[StepOutput]: ...

    def result(self, seq: Sequence) -> GenerationResult: ...

    def session_affinity(self, session_id: str) -> dict[str, str]: ...

    def pin_session(self, session_id: str, affinity: dict) -> None: ...
