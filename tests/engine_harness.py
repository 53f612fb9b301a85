"""What the whole-engine test modules (tests/test_engine_outputs.py, tests/test_engine_drafting.py,
tests/test_engine_calibration.py, tests/test_engine_interface.py) share: a prompt, a fixed-k configuration that skips
calibration, greedy sampling options, and plain decoding's output for the prompt (a module fixture)."""

from __future__ import annotations

import pytest

from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.engines.local import build_engine

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]
FIXED_K = EngineConfig(spec=SpecConfig(adaptive=False, k_init=4), calibrate=False)


def _greedy(max_tokens: int = 48, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


# A module imports the fixture by this name (pytest finds a fixture by the name it is given; the import keeps ruff from
# reading the test arguments as redefinitions).
@pytest.fixture(scope="module", name="plain_output")
def plain_output_fixture(tiny_models) -> list[int]:
    return build_engine(tiny_models[0], None).generate([PROMPT], _greedy())[0].token_ids
