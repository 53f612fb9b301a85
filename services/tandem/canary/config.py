"""How a gateway turns on the canary: options (from `tandem serve` flags or the environment) and a started
controller.

Environment (the Helm chart sets the first):
    TANDEM_CANARY_ARMS         JSON list of arms [{name, draftModel, weight}, ...]; unset or empty: no canary
    TANDEM_CANARY_DEPLOYMENT   the shared state's name (default "default"); gateways of one deployment share it
    TANDEM_CANARY_THRESHOLDS   JSON object of analysis thresholds, e.g. {"min_sessions": 100}
    TANDEM_CANARY_STEPS        promotion schedule in percent, e.g. "5,25,50,100"
    TANDEM_CANARY_SECRET_FILE  a file holding the assignment secret every replica shares (or --canary-secret-file)
    TANDEM_CANARY_SECRET       the secret itself, where no file is given (see secret.py; unset: random per process)
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from tandem.canary.analysis import Thresholds
from tandem.canary.arms import ArmSpec, arms_from_env, validate_arms
from tandem.canary.controller import CanaryController
from tandem.canary.greedy_check import GreedyChecker, PlainReference
from tandem.canary.secret import CanarySecret, configured_secret
from tandem.canary.state import DEFAULT_STEPS, validate_steps
from tandem.canary.store import open_canary_store
from tandem.errors import InvalidArgument

ENV_DEPLOYMENT = "TANDEM_CANARY_DEPLOYMENT"
ENV_THRESHOLDS = "TANDEM_CANARY_THRESHOLDS"
ENV_STEPS = "TANDEM_CANARY_STEPS"


@dataclass(slots=True, frozen=True)
class CanaryOptions:
    arms: tuple[ArmSpec, ...]
    deployment: str = "default"
    thresholds: Thresholds = field(default_factory=Thresholds)
    steps: tuple[float, ...] = DEFAULT_STEPS
    greedy_check_rate: float = 0.05  # share of greedy sessions of a draft canary re-run as plain decoding
    greedy_check_tokens: int = 64
    decide_interval_s: float = 10.0
    cache_ttl_s: float = 1.0
    secret: CanarySecret | None = field(default=None, repr=False)  # None: a random one per process (secret.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "arms", validate_arms(self.arms))
        if self.secret is not None and not isinstance(self.secret, CanarySecret):
            raise InvalidArgument("canary_secret: expected a CanarySecret (see tandem.canary.secret)")
        object.__setattr__(self, "steps", validate_steps(self.steps))
        if not self.deployment:
            raise InvalidArgument("canary_deployment: must be a non-empty name")
        if not 0.0 <= self.greedy_check_rate <= 1.0:
            raise InvalidArgument(f"canary_greedy_check_rate: must be in [0, 1], got {self.greedy_check_rate}")
        if self.greedy_check_tokens < 1:
            raise InvalidArgument(f"canary_greedy_check_tokens: must be at least 1, got {self.greedy_check_tokens}")
        for name in ("decide_interval_s", "cache_ttl_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise InvalidArgument(f"canary_{name.removesuffix('_s')}: must be a positive number of seconds")


def thresholds_from_json(text: str) -> Thresholds:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"thresholds: not valid JSON ({exc.msg})") from exc
    if not isinstance(data, dict):
        raise InvalidArgument("thresholds: expected a JSON object")
    return Thresholds.from_dict(data)


def parse_steps(parts: Iterable[str]) -> tuple[float, ...]:
    """A promotion schedule from its percentages as written: `--steps 5 25 50 100`, or TANDEM_CANARY_STEPS split at
    its commas."""
    parts = list(parts)
    try:
        return validate_steps(float(part) for part in parts)
    except ValueError as exc:
        if isinstance(exc, InvalidArgument):
            raise
        raise InvalidArgument(f"steps: expected percentages, got {' '.join(parts)!r}") from None


def options_from_env(environ: Mapping[str, str] | None = None, **overrides) -> CanaryOptions | None:
    """Options from the environment (see the module docstring), `overrides` winning; None without arms."""
    env = os.environ if environ is None else environ
    arms = overrides.pop("arms", None) or arms_from_env(env)
    if not arms:
        return None
    values: dict = {"deployment": env.get(ENV_DEPLOYMENT) or "default"}
    if text := env.get(ENV_THRESHOLDS, "").strip():
        values["thresholds"] = thresholds_from_json(text)
    if text := env.get(ENV_STEPS, "").strip():
        values["steps"] = parse_steps(text.split(","))
    if overrides.get("secret") is None:
        values["secret"] = configured_secret(environ=env)
    values.update({key: value for key, value in overrides.items() if value is not None})
    return CanaryOptions(arms=tuple(arms), **values)


def start_controller(options: CanaryOptions, redis_url: str | None, reference: PlainReference | None = None,
                     served: set[str] | None = None, meter=None) -> CanaryController:
    """A controller on Redis (or memory without a URL) with its background ticker running. `reference` enables
    greedy-equality checks; `served`: the arms this replica serves (None: every configured arm)."""
    greedy = None
    if reference is not None and options.greedy_check_rate > 0:
        greedy = GreedyChecker(reference, rate=options.greedy_check_rate, max_tokens=options.greedy_check_tokens)
    controller = CanaryController(open_canary_store(redis_url), options.deployment, arms=options.arms, served=served,
                                  thresholds=options.thresholds, steps=options.steps, cache_ttl_s=options.cache_ttl_s,
                                  greedy=greedy, meter=meter, secret=options.secret)
    controller.start(options.decide_interval_s)
    return controller
