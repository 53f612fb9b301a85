"""A minimal in-process arm router: arm name -> SpeculativeEngine, one request at a time, timed and recorded.

What the gateway does per request, without gRPC: ask the controller for the arm, run the request on that arm's
engine, measure time to first token and TPOT, record the outcome, and maybe run a greedy-equality check. Used by
tests and for offline canary trials (`build_arm_engines` builds one engine per arm from loaded models).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tandem.canary.arms import ArmSpec
from tandem.canary.controller import Assignment, CanaryController
from tandem.canary.observations import Outcome
from tandem.core.config import EngineConfig, SamplingParams
from tandem.core.engine import GenerationResult, SpeculativeEngine
from tandem.errors import InvalidArgument
from tandem.local_engine import build_engine


@dataclass(slots=True, frozen=True)
class Routed:
    assignment: Assignment
    result: GenerationResult
    outcome: Outcome


def build_arm_engines(arms: list[ArmSpec], load: Callable[[str], object], default_target: str,
                      default_draft: str, config: EngineConfig) -> dict[str, SpeculativeEngine]:
    """One engine per arm. `load(name)` returns a LoadedModel-like object (cached by the caller); an arm's empty
    target/draft means the defaults; arm overrides (k_max, enabled) apply to `config.spec`."""
    engines = {}
    for arm in arms:
        spec = arm.spec_config(config.spec)
        arm_config = EngineConfig(spec=spec, max_batch=config.max_batch, calibrate=config.calibrate)
        draft = load(arm.draft or default_draft) if spec.speculating and (arm.draft or default_draft) else None
        engines[arm.name] = build_engine(load(arm.target or default_target), draft, arm_config)
    return engines


class ArmRouter:
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
