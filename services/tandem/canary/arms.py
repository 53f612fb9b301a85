"""Canary arms: what each arm serves (target, draft, speculation overrides) and its share of sessions.

The Helm chart passes the in-gateway arms as JSON in TANDEM_CANARY_ARMS: a list of {name, draftModel, weight}
(percent, summing to 100). Keys may also be spelled as in Python (draft, target, k_max, enabled).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tandem.core.config import SpecConfig
from tandem.errors import InvalidArgument

ENV_ARMS = "TANDEM_CANARY_ARMS"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
WEIGHT_TOLERANCE = 1e-6
# JSON key -> field; camelCase as the Helm chart writes it, snake_case as Python does.
KEY_ALIASES = {
    "name": "name", "weight": "weight",
    "target": "target", "targetModel": "target", "target_model": "target",
    "draft": "draft", "draftModel": "draft", "draft_model": "draft",
    "k_max": "k_max", "kMax": "k_max",
    "enabled": "enabled", "speculate": "enabled",
}


@dataclass(slots=True, frozen=True)
class ArmSpec:
    """One arm. Empty target/draft and None overrides mean "the gateway's default" (its --target, --draft, flags)."""

    name: str
    weight: float = 0.0
    target: str = ""
    draft: str = ""
    k_max: int | None = None
    enabled: bool | None = None  # speculation on/off for this arm

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME_PATTERN.match(self.name):
            raise InvalidArgument(f"name: arm names are 1-63 letters, digits, '_', '.', '-', got {self.name!r}")
        weight = self.weight
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) \
                or not 0.0 <= weight <= 100.0:
            raise InvalidArgument(f"weight: arm {self.name!r}: must be a percentage in [0, 100], got {weight!r}")
        object.__setattr__(self, "weight", float(weight))
        for field_name in ("target", "draft"):
            if not isinstance(getattr(self, field_name), str):
                raise InvalidArgument(f"{field_name}: arm {self.name!r}: must be a string")
        if self.k_max is not None and (isinstance(self.k_max, bool) or not isinstance(self.k_max, int)
                                       or not 0 <= self.k_max <= 32):
            raise InvalidArgument(f"k_max: arm {self.name!r}: must be an integer in [0, 32], got {self.k_max!r}")
        if self.enabled is not None and not isinstance(self.enabled, bool):
            raise InvalidArgument(f"enabled: arm {self.name!r}: must be true or false, got {self.enabled!r}")

    @classmethod
    def from_dict(cls, data: Mapping) -> ArmSpec:
        if not isinstance(data, Mapping):
            raise InvalidArgument(f"arms: each arm must be an object, got {data!r}")
        unknown = sorted(set(data) - set(KEY_ALIASES))
        if unknown:
            raise InvalidArgument(f"arms: unknown key(s) {unknown} (known: {sorted(KEY_ALIASES)})")
        fields = {KEY_ALIASES[key]: value for key, value in data.items()}
        if "name" not in fields:
            raise InvalidArgument("name: every arm needs a name")
        fields["target"] = fields.get("target") or ""
        fields["draft"] = fields.get("draft") or ""
        return cls(**fields)

    def to_dict(self) -> dict:
        data = {"name": self.name, "weight": self.weight, "target": self.target, "draft": self.draft}
        if self.k_max is not None:
            data["k_max"] = self.k_max
        if self.enabled is not None:
            data["enabled"] = self.enabled
        return data

    def with_weight(self, weight: float) -> ArmSpec:
        return dataclasses.replace(self, weight=weight)

    def spec_config(self, base: SpecConfig) -> SpecConfig:
        """`base` (the gateway's speculation settings) with this arm's overrides applied."""
        spec = base
        if self.enabled is not None:
            spec = dataclasses.replace(spec, enabled=self.enabled)
        if self.k_max is not None:
            spec = dataclasses.replace(spec, k_max=self.k_max, k_init=min(spec.k_init, self.k_max))
        return spec

    def same_model_as(self, other: ArmSpec) -> bool:
        """True when both arms decode with the same target (so greedy outputs must agree token for token)."""
        return self.target == other.target


def validate_arms(arms: Iterable[ArmSpec]) -> tuple[ArmSpec, ...]:
    """At least one arm, unique names, weights summing to 100."""
    arms = tuple(arms)
    if not arms:
        raise InvalidArgument("arms: list at least one arm")
    names = [arm.name for arm in arms]
    if len(set(names)) != len(names):
        duplicates = sorted({name for name in names if names.count(name) > 1})
        raise InvalidArgument(f"arms: names must be unique, repeated: {duplicates}")
    total = sum(arm.weight for arm in arms)
    if abs(total - 100.0) > WEIGHT_TOLERANCE:
        raise InvalidArgument(f"weights: must sum to 100, got {total:g}")
    return arms


def parse_arms(text: str) -> tuple[ArmSpec, ...]:
    """Arms from JSON: a list of arm objects (as in TANDEM_CANARY_ARMS)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"arms: not valid JSON ({exc.msg})") from exc
    if not isinstance(data, list):
        raise InvalidArgument("arms: expected a JSON list of arms")
    return validate_arms(ArmSpec.from_dict(item) for item in data)


def arms_from_env(environ: Mapping[str, str] | None = None) -> tuple[ArmSpec, ...]:
    """The arms in TANDEM_CANARY_ARMS, or () when it is unset or empty."""
    text = (os.environ if environ is None else environ).get(ENV_ARMS, "").strip()
    return parse_arms(text) if text else ()


def fingerprint(arms: Iterable[ArmSpec]) -> str:
    """Identifies a configuration of arms regardless of their (runtime-changing) weights."""
    shape = [{k: v for k, v in arm.to_dict().items() if k != "weight"} for arm in arms]
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]
