"""The multi-turn benchmark against a real gateway: follow-ups in the same session reuse the cached conversation,
and produce exactly what a fresh session produces."""

from __future__ import annotations

import asyncio

from gateway_harness import ServerThread, tiny_backend
from tandem.bench import turns
from tandem.gateway.validate import GatewayLimits


def test_follow_ups_reuse_the_sessions_cache_and_match_fresh_sessions(tiny_models) -> None:
    target, draft, _ = tiny_models
    server = ServerThread(tiny_backend(target, draft), limits=GatewayLimits(max_prompt_tokens=4096))
    try:
        engine = server.engine
        prompts = ["def add(a, b):", "Write a loop"]
        report = asyncio.run(turns.run(server.address, prompts, max_tokens=16))
        assert report["prompts"] == 2
        for row in report["follow_ups"]:
            assert row["reused"]["tokens"] == row["fresh"]["tokens"] == 16 and row["same_output"]
        # Each reused follow-up found turn 1's conversation cached on both models; the fresh ones found nothing.
        assert engine.verifier.runner.reused_tokens > 2 * 16
        assert engine.drafter.runner.reused_tokens > 0
        assert report["reused"]["mean_ttft_s"] > 0 and report["ttft_fresh_over_reused"] > 0
    finally:
        server.stop()
