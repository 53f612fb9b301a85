"""Backend: what a built engine gives a server, whatever built it (in process, Ray pools, shared pools).

A backend is the engine, the tokenizer that feeds it, and the names the server shows its clients for the models
behind it. Over Ray pools it may hold several engine lanes over the same workers (`engine_lanes`), so that one
lane drafts while another verifies: each lane has its own pool clients (its own wire-id prefix: to the workers, a
lane is one more gateway), and every lane shares the first lane's cost model and acceptance prior, since the
measured costs are the same hardware's. The serving loop that splits requests over lanes is the gateway's.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from tandem.core.config import EngineConfig
from tandem.core.engine import SpeculativeEngine
from tandem.core.protocol import Drafter, Verifier
from tandem.errors import InvalidArgument

Sides = Callable[[int], tuple[Verifier, Drafter | None]]  # lane -> the pool clients its engine drives


@dataclass(slots=True, frozen=True)
class ModelLimits:
    """What the loaded models accept: token ids below vocab_size, drafting up to max_k, context_window in all."""

    vocab_size: int
    max_k: int
    context_window: int | None = None


def display_name(model: str) -> str:
    """How a model is named to clients (model info, /v1/models, metric labels): a registry or hub name as given,
    a local directory by its base name only (a full path says how the server's disk is laid out), a hub id pinned to
    a commit (org/name@<sha>) by its id: clients name the model, the pin is the server's business."""
    if re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", model):
        return model.split("@", 1)[0]
    name = model.rstrip("/\\") or model
    if name.startswith(("/", "./", "../", "~", "\\")) or (os.sep in name and os.path.isdir(name)) \
            or ":\\" in name[:3]:
        return os.path.basename(name.replace("\\", "/").rstrip("/")) or name
    return model


@dataclass(slots=True)
class Backend:
    """A loaded engine and what a server needs to describe and feed it. `lanes`: more engines over the same
    pools (`engine_lanes`), each driven by its own loop; `engine` is the first lane."""

    engine: SpeculativeEngine
    tokenizer: object
    target_name: str
    draft_name: str = ""
    lanes: tuple[SpeculativeEngine, ...] = ()
    fills_cpus: bool = False  # its forwards run in this process on as many CPU threads as it may use (gateway.loop)

    def __post_init__(self) -> None:
        # Model info, /v1/models and metric labels name a model given as a path by its directory's name only.
        self.target_name, self.draft_name = display_name(self.target_name), display_name(self.draft_name)

    @property
    def engines(self) -> list[SpeculativeEngine]:
        return [self.engine, *self.lanes]

    @property
    def model_limits(self) -> ModelLimits:
        spec = self.engine.config.spec
        return ModelLimits(vocab_size=self.engine.verifier.vocab_size,
                           max_k=spec.k_max if self.engine.speculating else 0,
                           context_window=self.engine.verifier.context_window)


def engine_lanes(sides: Sides, lanes: int, config: EngineConfig, eos: frozenset[int],
                 decode: Callable[[list[int]], str]) -> list[SpeculativeEngine]:
    """`lanes` engines, each over the pool clients `sides(lane)` returns; the first calibrates, the others share
    its cost model and acceptance prior."""
    if lanes < 1:
        raise InvalidArgument(f"lanes: must be at least 1, got {lanes}")
    verifier, drafter = sides(0)
    first = SpeculativeEngine(verifier, drafter, config, eos, decode)
    others = dataclasses.replace(config, calibrate=False)
    return [first, *(SpeculativeEngine(*sides(lane), others, eos, decode, costs=first.costs, prior=first.prior)
                     for lane in range(1, lanes))]
