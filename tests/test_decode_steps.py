"""Multi-step decoding (EngineConfig.decode_steps, core.decode_steps): plain rows decode several tokens per verifier
call, each fed back on the device, and give exactly the tokens one step a call gives, greedy or sampled; stops and
max_tokens cut a block, and what the verifier decoded past them is rolled back."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from tandem.core import policy
from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.local import LocalVerifier
from tandem.core.protocol import VerifyRequest
from tandem.core.runner import ModelRunner
from tandem.engines.local import build_engine
from tandem.workers.batcher import CallBatcher
from tandem.workers.worker_base import WorkerReply

PROMPTS = [[72, 101, 108, 108, 111, 44, 32, 119], [40, 41, 42], [97, 98, 99, 100, 101, 102, 103, 104, 105, 106, 107],
           [5, 6]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


def _plain(steps: int, **config) -> EngineConfig:
    return EngineConfig(spec=SpecConfig(enabled=False), calibrate=False, decode_steps=steps, **config)


class _Calls:
    """Counts the verifier's calls and the steps each row was asked for: the real verifier answers them."""

    def __init__(self, engine) -> None:
        self.steps: list[list[int]] = []
        self.appended: list[list[int]] = []  # tokens each row sends that the verifier did not decode itself
        self.decoded: list[int] = []  # tokens the verifier decoded per call
        verify = engine.verifier.verify

        def counted(requests: list[VerifyRequest]):
            self.steps.append([r.steps for r in requests])
            self.appended.append([len(r.append) for r in requests])
            results = verify(requests)
            self.decoded.append(sum(0 if r.prefilling else 1 + len(r.more) for r in results))
            return results
        engine.verifier.verify = counted


def _hf_greedy(target, prompt: list[int], tokens: int) -> list[int]:
    """Hugging Face's own generate: an implementation that shares no code with ours."""
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=tokens,
                                min_new_tokens=tokens, pad_token_id=0, temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("steps", [4, 7])
def test_greedy_blocks_are_hugging_faces_tokens_in_fewer_calls(tiny_models, steps: int) -> None:
    target = tiny_models[0]
    expected = [_hf_greedy(target, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
    engine = build_engine(target, None, _plain(steps))
    calls = _Calls(engine)
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == expected
    # The first round decodes one token (it streams at once), then blocks of `steps` up to max_tokens (30).
    assert calls.steps[0] == [1] * len(PROMPTS) and max(map(max, calls.steps)) == steps
    assert len(calls.steps) == 1 + -(-(GREEDY.max_tokens - 1) // steps)
    assert not any(map(any, calls.appended[1:])), "the engine resent tokens the verifier decoded"
    assert not engine.verifier.runner.states, "caches not released"


def test_sampled_rows_give_one_step_decodings_tokens(tiny_models) -> None:
    """Random numbers are keyed by (seed, position): seeded (Gumbel) and unseeded (the engine's seed) rows draw the
    same tokens whether a call decodes one of them or several, beside greedy batch mates."""
    target = tiny_models[0]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=25, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=20, engine_seed=99, max_tokens=25, ignore_eos=True),
              GREEDY,
              SamplingParams(temperature=0.7, engine_seed=5, max_tokens=17, ignore_eos=True)]

    def run(steps: int) -> list[list[int]]:
        return [r.token_ids for r in build_engine(target, None, _plain(steps)).generate(PROMPTS, params)]

    one = run(1)
    assert len({tuple(tokens) for tokens in one}) == len(PROMPTS)
    assert run(5) == one and run(3) == one


def _stop_inside_a_block(target, reference: list[int], kind: str) -> tuple[int, SamplingParams]:
    """Where a stop completes in `reference` (after token 7, not at a block's end: blocks of 6 after the first
    token), and params that stop there: by a stop token id, or by a stop string (its text, first seen there)."""
    decode = target.tokenizer.decode
    for at in range(7, len(reference)):
        if at % 6 == 0:  # the last token of a block
            continue
        if kind == "token" and reference[at] not in reference[:at]:
            return at, dataclasses.replace(GREEDY, stop_token_ids=(reference[at],))
        text, before = decode(reference[: at + 1]), decode(reference[:at])
        stop = next((text[-n:] for n in range(2, 6) if text[-n:] not in before and text[-n:].strip()), None)
        if kind == "string" and stop is not None and text.startswith(before):
            return at, dataclasses.replace(GREEDY, stop=(stop,))
    raise AssertionError(f"no {kind} stop inside a block in {reference}")


@pytest.mark.parametrize("kind", ["token", "string"])
def test_a_stop_inside_a_block_cuts_it_and_the_sessions_next_turn_starts_from_the_kept_tokens(tiny_models,
                                                                                              kind: str) -> None:
    """A block cut by a stop: a stop token ends it on a CPU (reading a choice costs nothing there); past a stop
    string, which only the engine sees, the verifier decodes on. Either way the engine keeps plain decoding's tokens,
    and the session's next turn, which reuses the retained cache, gives what Hugging Face gives for it."""
    target = tiny_models[0]
    reference = _hf_greedy(target, PROMPTS[0], 20)
    stop_at, stopping = _stop_inside_a_block(target, reference, kind)
    engine = build_engine(target, None, _plain(6))
    calls = _Calls(engine)

    def turn(prompt: list[int], params: SamplingParams):
        seq = engine.sequences[engine.add_request(prompt, params, session_id="s")]
        while engine.has_unfinished():
            engine.step()
        return seq

    one_step = build_engine(target, None, _plain(1)).generate([PROMPTS[0]], stopping)[0]
    first = turn(PROMPTS[0], stopping)
    assert first.output == one_step.token_ids == reference[: len(first.output)] and first.finish_reason == "stop"
    # Token 0 alone, then blocks 1-6, 7-12, 13-18: a stop token ends its block there, a stop string does not.
    decoded = sum(calls.decoded)
    assert decoded == stop_at + 1 if kind == "token" else decoded == -(-stop_at // 6) * 6 + 1, (decoded, stop_at)
    reused = engine.verifier.runner.reused_tokens
    follow_up = PROMPTS[0] + first.output + [7, 8, 9]
    again = turn(follow_up, GREEDY)
    assert engine.verifier.runner.reused_tokens - reused >= len(PROMPTS[0]) + len(first.output)  # the kept cache
    assert again.output == _hf_greedy(target, follow_up, GREEDY.max_tokens)


def test_rows_that_need_the_host_between_tokens_decode_one_a_call_beside_ones_that_do_not(tiny_models) -> None:
    target = tiny_models[0]
    params = [GREEDY, dataclasses.replace(GREEDY, logprobs=2), dataclasses.replace(GREEDY, presence_penalty=0.5),
              dataclasses.replace(GREEDY, max_tokens=9)]
    outputs, logprobs = {}, {}
    for steps in (1, 4):
        engine = build_engine(target, None, _plain(steps))
        ids = [engine.add_request(prompt, p) for prompt, p in zip(PROMPTS, params, strict=True)]
        seqs = [engine.sequences[i] for i in ids]
        rounds = [0] * len(seqs)
        while engine.has_unfinished():
            for out in engine.step():
                rounds[[s.request_id for s in seqs].index(out.request_id)] += 1
        outputs[steps] = [s.output for s in seqs]
        logprobs[steps] = [[t.logprob for t in s.logprobs] for s in seqs if s.logprobs is not None]
        if steps == 4:
            assert rounds[1] == rounds[2] == GREEDY.max_tokens  # logprobs, penalties: one token a call
            assert rounds[0] < GREEDY.max_tokens / 2 and rounds[3] <= 1 + 2  # 1 + 4 + 4 = 9 tokens
    assert outputs[4] == outputs[1]
    # The same positions scored in forwards of other batch shapes: equal up to float32 rounding.
    assert torch.allclose(torch.tensor(logprobs[4]), torch.tensor(logprobs[1]), atol=1e-5)


def test_a_new_request_gets_its_first_token_from_a_one_step_call(tiny_models) -> None:
    """A step that holds a new row (or one still prefilling) runs a token a row, so the newcomer's first token comes
    as soon as it would without blocks; the blocks resume after it."""
    target = tiny_models[0]
    engine = build_engine(target, None, _plain(5, prefill_chunk=0))
    calls = _Calls(engine)
    first = engine.add_request(PROMPTS[0], GREEDY)
    for _ in range(3):
        engine.step()
    late = engine.add_request(PROMPTS[2], GREEDY)
    seqs = [engine.sequences[first], engine.sequences[late]]
    outputs = {out.request_id: out.new_token_ids for out in engine.step()}
    assert calls.steps[:4] == [[1], [5], [5], [1, 1]] and len(outputs[late]) == len(outputs[first]) == 1
    engine.step()
    assert calls.steps[4] == [5, 5]
    while engine.has_unfinished():
        engine.step()
    assert [seq.output for seq in seqs] == [_hf_greedy(target, p, GREEDY.max_tokens) for p in (PROMPTS[0], PROMPTS[2])]


def test_speculating_steps_decode_one_token_a_call(tiny_models) -> None:
    """A step in which a row drafts runs one forward for every row: its batch mates would otherwise wait."""
    target, draft, _ = tiny_models
    engine = build_engine(target, draft, EngineConfig(spec=SpecConfig(adaptive=False, k_init=3), calibrate=False,
                                                      decode_steps=8))
    calls = _Calls(engine)
    plain = build_engine(target, None, EngineConfig(calibrate=False))
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == [
        r.token_ids for r in plain.generate(PROMPTS, GREEDY)]
    assert all(steps == 1 for call in calls.steps for steps in call)


def test_a_block_stops_where_the_kv_budget_ends_and_keeps_what_it_decoded(tiny_models) -> None:
    target = tiny_models[0]
    prompt = list(range(10, 70))  # 60 tokens; the budget holds 64
    verifier = LocalVerifier(ModelRunner(target.model, kv_tokens=64, prefix_cache=False))
    first = verifier.verify([VerifyRequest("a", 0, prompt, None, GREEDY)])[0]
    result = verifier.verify([VerifyRequest("a", len(prompt), [first.next_token], None, GREEDY, steps=10)])[0]
    expected = _hf_greedy(target, prompt, 5)
    assert [first.next_token, result.next_token, *result.more] == expected[: 2 + len(result.more)]
    assert 1 <= len(result.more) < 9
    state = verifier.runner.states["a"]
    assert state.cached == len(state.tokens) - 1 == len(prompt) + 1 + len(result.more)


def test_a_fallback_session_counts_a_blocks_tokens_toward_its_next_probe() -> None:
    state = policy.PolicyState(fallback=True, rounds_since_probe=2, probe_interval=16)
    policy.decoded_plainly(state, 5)
    assert state.rounds_since_probe == 7
    speculating = policy.PolicyState(fallback=False)
    policy.decoded_plainly(speculating, 5)
    assert speculating.rounds_since_probe == 0


def test_a_merged_worker_call_runs_one_step_for_every_caller() -> None:
    """Calls of several gateways merged into one forward: one caller's blocks would hold the others' replies."""
    seen: list[list[int]] = []
    started, release = threading.Event(), threading.Event()

    def run(requests: list[VerifyRequest]) -> WorkerReply:
        seen.append([r.steps for r in requests])
        started.set()
        release.wait(5)
        return WorkerReply(results=[None] * len(requests))

    batcher = CallBatcher(run, window_s=0.05)
    alone = VerifyRequest("a", 0, [1], None, GREEDY, steps=4)
    first = threading.Thread(target=batcher.submit, args=([alone],))
    first.start()
    started.wait(5)
    others = [threading.Thread(target=batcher.submit, args=([dataclasses.replace(alone, seq_id=n)],))
              for n in ("b", "c")]
    for thread in others:
        thread.start()
    release.set()
    for thread in [first, *others]:
        thread.join(5)
    assert seen[0] == [4]  # a call alone keeps its steps
    assert seen[1] == [1, 1]  # the two queued behind it, merged
