"""The canary as the gateway's edge plug-in (tandem.gateway.arms): `CanaryArms` is handed to the gateway, which
starts it once every arm's engine runs; the started `CanaryRouter` places each request with the controller's sticky
weighted assignment and feeds what each request produced to the arm's observations and greedy-equality checks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.canary.assignment import Assignment
from tandem.canary.config import CanaryOptions, start_controller
from tandem.canary.controller import CanaryController
from tandem.canary.observations import Outcome
from tandem.gateway.arms import ArmOutcome, PlainDecoder

METER_NAME = "tandem.canary"


@dataclass(slots=True, frozen=True)
class CanaryRoute:
    """A request's assignment; `arm` is what the gateway serves it on."""

    assignment: Assignment

    @property
    def arm(self) -> str:
        return self.assignment.arm.name


class CanaryRouter:
    """An ArmRouter over a started CanaryController (which it closes)."""

    def __init__(self, controller: CanaryController) -> None:
        self.controller = controller

    def route(self, session_id: str, request_id: str, tenant: str) -> CanaryRoute | None:
        """The tenant keys the assignment (the same session id in two tenants is placed independently) and is
        recorded with the outcome, so the analysis can cap each tenant's weight."""
        assignment = self.controller.arm_for(session_id, request_id, tenant)
        return CanaryRoute(assignment) if assignment is not None else None

    def record(self, route: CanaryRoute, outcome: ArmOutcome) -> None:
        assignment = route.assignment
        if outcome.failed:
            self.controller.record(assignment, Outcome(assignment.session, error=True))
            return
        self.controller.record(assignment, Outcome.from_request(assignment.session, outcome.stats,
                                                                outcome.first_token_at, outcome.finished_at,
                                                                outcome.completion_tokens))
        self.controller.check_greedy(assignment, outcome.greedy, outcome.prompt_ids, outcome.token_ids)

    def close(self) -> None:
        self.controller.close()


class CanaryArms:
    """The canary's ArmRouterFactory: its options, and the Redis its replicas share the state through (None: this
    process's memory)."""

    def __init__(self, options: CanaryOptions, redis_url: str | None = None) -> None:
        self.options, self.redis_url = options, redis_url

    @property
    def arms(self) -> tuple[str, ...]:
        """The configured arms' names, the baseline first: the order the gateway's backends are built in."""
        return tuple(arm.name for arm in self.options.arms)

    def start(self, served: Sequence[str], plain: PlainDecoder, meter_provider: object | None) -> CanaryRouter:
        """A controller with its ticker running; `plain` re-runs a sampled share of greedy sessions (when the
        options' greedy_check_rate is above 0)."""
        meter = meter_provider.get_meter(METER_NAME) if meter_provider is not None else None
        return CanaryRouter(start_controller(self.options, self.redis_url, reference=plain, served=set(served),
                                             meter=meter))
