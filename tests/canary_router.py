"""The canary without a gateway, for tests: requests run one at a time on in-process SpeculativeEngines, one per arm.

What the gateway does per request (tandem.gateway.generation with tandem.canary.plugin), without gRPC: ask the
controller for the arm, run the request on that arm's engine, measure time to first token and TPOT, record the
outcome, and maybe run a greedy-equality check against `engine_reference`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from tandem.canary.assignment import Assignment
from tandem.canary.controller import CanaryController
from tandem.canary.greedy_check import PlainReference
from tandem.canary.observations import Outcome
from tandem.core.config import SamplingParams
from tandem.core.engine import SpeculativeEngine
from tandem.core.requests import GenerationResult
from tandem.errors import InvalidArgument


@dataclass(slots=True, frozen=True)
class Routed:
    assignment: Assignment
    result: GenerationResult
    outcome: Outcome


def engine_reference(engine: SpeculativeEngine) -> PlainReference:
    """Plain greedy decoding (max_k=0) on an in-process engine; call it only while nothing else steps it."""

    def reference(prompt_ids: list[int], n: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        request_id = engine.add_request(prompt_ids, params, f"canary-check-{uuid.uuid4().hex}", max_k=0)
        seq = engine.sequences[request_id]
        while request_id in engine.sequences:
            engine.step()
        return list(seq.output)

    return reference


class OfflineArmRouter:
    def __init__(self, controller: CanaryController, engines: Mapping[str, SpeculativeEngine]) -> None:
        state = controller.state(refresh=True)
        if state is not None and (missing := sorted(set(state.weights) - set(engines))):
            raise InvalidArgument(f"arms: no engine for {missing}")
        self.controller, self.engines = controller, dict(engines)

    def generate(self, prompt_ids: list[int], params: SamplingParams, session_id: str = "",
                 request_id: str = "", tenant: str = "") -> Routed:
        assignment = self.controller.arm_for(session_id, request_id, tenant)
        if assignment is None:
            raise InvalidArgument("arms: the canary has no arms (set TANDEM_CANARY_ARMS or `tandem canary set`)")
        engine = self.engines[assignment.arm.name]
        rid = engine.add_request(prompt_ids, params, request_id or None)
        seq = engine.sequences[rid]
        first_token_at = None
        try:
            while rid in engine.sequences:
                outputs = engine.step()
                if first_token_at is None and any(o.request_id == rid and o.new_token_ids for o in outputs):
                    first_token_at = time.monotonic()
        except Exception:
            engine.abort(rid)
            self.controller.record(assignment, Outcome(assignment.session, error=True))
            raise
        finished_at = time.monotonic()
        result = engine.result(seq)
        outcome = Outcome.from_request(assignment.session, result.stats, first_token_at, finished_at,
                                       len(result.token_ids))
        self.controller.record(assignment, outcome)
        self.controller.check_greedy(assignment, params.greedy, prompt_ids, result.token_ids)
        return Routed(assignment, result, outcome)
