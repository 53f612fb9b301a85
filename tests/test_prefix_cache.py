"""Prefix caching: a new request starts from a copy of the longest cached prefix of its prompt (core.runner), and its
output is what computing the whole prompt gives (float32, greedy and seeded sampling)."""

from __future__ import annotations

import pytest
import torch

from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
from tandem.core.prefixes import MIN_SHARED_PREFIX
from tandem.core.runner import ModelRunner
from tandem.core.slots import MIN_CAPACITY
from tandem.engines.local import build_engine

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=NEW_TOKENS, ignore_eos=True, seed=7)
FIXED_K = EngineConfig(spec=SpecConfig(adaptive=False, k_init=3), calibrate=False)


@pytest.fixture(scope="module")
def prompts(tiny_models) -> list[list[int]]:
    """A 40-token system prompt shared by four requests, each with a tail of its own."""
    vocab = len(tiny_models[0].tokenizer)
    generator = torch.Generator().manual_seed(99)
    system = torch.randint(0, vocab, (40,), generator=generator).tolist()
    return [system + torch.randint(0, vocab, (int(n),), generator=generator).tolist() for n in (5, 9, 1, 17)]


@pytest.fixture(scope="module")
def expected(tiny_models, prompts) -> dict[str, list[list[int]]]:
    """Each prompt computed whole: a plain engine without prefix caching, one request at a time."""
    plain = build_engine(tiny_models[0], None, EngineConfig(calibrate=False), prefix_cache=False)
    return {name: [plain.generate([p], params)[0].token_ids for p in prompts]
            for name, params in (("greedy", GREEDY), ("sampled", SAMPLED))}


@pytest.mark.parametrize("params", ["greedy", "sampled"])
def test_requests_after_one_with_the_same_system_prompt_copy_it_and_give_the_same_tokens(
        tiny_models, prompts, expected, params) -> None:
    target, draft, _ = tiny_models
    engine = build_engine(target, draft, FIXED_K)
    results = [engine.generate([p], GREEDY if params == "greedy" else SAMPLED)[0] for p in prompts]
    assert [result.token_ids for result in results] == expected[params]
    assert [result.stats["cached_prompt_tokens"] >= 40 for result in results] == [False, True, True, True]
    for runner in (engine.verifier.runner, engine.drafter.runner):
        # Every request after the first copied the 40-token system prompt, or more of a finished one.
        assert runner.shared_tokens >= 3 * 40
        assert not runner.states and runner.retained_prefixes >= 1


def test_a_running_request_shares_its_prefix_with_one_that_arrives_later(tiny_models, prompts, expected) -> None:
    target, draft, _ = tiny_models
    engine = build_engine(target, draft, FIXED_K)
    first = engine.add_request(prompts[0], GREEDY)
    engine.step()  # the first request's prompt is cached, and it goes on running
    assert engine.sequences[first].output and engine.verifier.runner.shared_tokens == 0
    second = engine.add_request(prompts[1], GREEDY)
    sequences = dict(engine.sequences)
    while engine.has_unfinished():
        engine.step()
    assert sequences[first].output == expected["greedy"][0] and sequences[second].output == expected["greedy"][1]
    assert engine.verifier.runner.shared_tokens >= 40 and engine.drafter.runner.shared_tokens >= 40


@pytest.mark.parametrize("same", [False, True], ids=["one-system-prompt", "one-prompt"])
def test_requests_arriving_together_compute_their_shared_prefix_once(tiny_models, prompts, expected, same) -> None:
    """Nothing held the prefix: the first request of the step computes it and the others copy it (a burst with one
    system prompt; the same prompt, as a request's n choices are)."""
    target, draft, _ = tiny_models
    engine = build_engine(target, draft, FIXED_K)
    batch = [prompts[0]] * 3 if same else prompts
    results = engine.generate(batch, GREEDY)
    assert [r.token_ids for r in results] == ([expected["greedy"][0]] * 3 if same else expected["greedy"])
    copied = [r.stats["cached_prompt_tokens"] for r in results]
    assert copied[0] == 0 and all(n >= (len(prompts[0]) - 1 if same else 40) for n in copied[1:]), copied
    for runner in (engine.verifier.runner, engine.drafter.runner):
        assert runner.shared_tokens >= 40 * (len(batch) - 1)


def test_only_requests_of_the_same_scope_share(tiny_models, prompts, expected) -> None:
    engine = build_engine(tiny_models[0], None, EngineConfig(calibrate=False))
    runner = engine.verifier.runner

    def run(prompt: list[int], scope: str) -> list[int]:
        request_id = engine.add_request(prompt, GREEDY, cache_scope=scope)
        sequence = engine.sequences[request_id]
        while engine.has_unfinished():
            engine.step()
        return sequence.output

    assert run(prompts[0], "alice") == expected["greedy"][0]
    assert run(prompts[1], "bob") == expected["greedy"][1] and runner.shared_tokens == 0
    assert run(prompts[2], "alice") == expected["greedy"][2] and runner.shared_tokens >= 40


def test_off_nothing_is_kept_or_copied(tiny_models, prompts, expected) -> None:
    engine = build_engine(tiny_models[0], tiny_models[1], FIXED_K, prefix_cache=False)
    assert [engine.generate([p], GREEDY)[0].token_ids for p in prompts] == expected["greedy"]
    for runner in (engine.verifier.runner, engine.drafter.runner):
        assert runner.shared_tokens == 0 and not runner.retained


def _runner(tiny_models, **options) -> ModelRunner:
    return ModelRunner(tiny_models[0].model, **options)


def _finish(runner: ModelRunner, seq_id: str, prompt: list[int]) -> None:
    """A request's sequence through the runner: its prompt cached, then released."""
    state = runner.state(seq_id, prompt=prompt)
    state.sync(0, prompt)
    runner.prefill(state, len(prompt))
    runner.release(seq_id)


def test_a_kept_prefix_another_holds_whole_is_dropped_and_the_kept_tokens_are_bounded(tiny_models, prompts) -> None:
    """What kept sequences reserve is bounded by --retain-tokens: each holds a slot as long as the cache's."""
    runner = _runner(tiny_models, retain_tokens=2 * MIN_CAPACITY)
    _finish(runner, "a", prompts[0])
    _finish(runner, "b", prompts[0])  # the same prompt again: one copy is kept
    assert runner.retained_prefixes == 1 and runner.shared_tokens == len(prompts[0]) - 1
    _finish(runner, "c", prompts[0] + [7, 8])  # holds all of the kept one
    assert [held.tokens for held in runner.retained.values()] == [prompts[0] + [7, 8]]
    _finish(runner, "d", prompts[3])  # shares the system prompt only: both kept
    assert runner.retained_prefixes == 2 and runner.cache.capacity == MIN_CAPACITY
    _finish(runner, "e", list(range(60, 60 + 70)))  # a third slot past the bound: the least recently used goes
    assert [held.tokens for held in runner.retained.values()] == [prompts[3], list(range(60, 60 + 70))]
    _finish(runner, "short", prompts[0][: MIN_SHARED_PREFIX - 1])  # too short to keep
    assert runner.retained_prefixes == 2 and not runner.states


def test_thousands_of_short_sessions_reserve_no_more_than_retain_tokens(tiny_models) -> None:
    """Each one-token session kept a 256-token slot, counted as its one token: 6000 of them made a worker reserve
    its whole KV budget (2M tokens for 29k held, +1.6 GB; soak probe). Counted as the slots they hold, what they
    reserve stays within --retain-tokens."""
    runner = _runner(tiny_models, retain_tokens=8 * MIN_CAPACITY, kv_tokens=1 << 20)
    for index in range(300):
        state = runner.state(f"r{index}", session=f"s{index}")
        state.sync(0, [5 + index % 50])
        runner.prefill(state, 1)
        runner.release(f"r{index}", retain=True)
    assert runner.retained_sessions == 8 and "s299" in runner.retained and "s0" not in runner.retained
    assert runner.kv_tokens_reserved <= 16 * MIN_CAPACITY  # (the slots grow by doubling: at most twice the kept)


def test_a_copied_prefix_scores_what_the_whole_prompt_does(tiny_models, prompts) -> None:
    shared, whole = _runner(tiny_models), _runner(tiny_models, prefix_cache=False)
    _finish(shared, "first", prompts[0])
    for runner in (shared, whole):
        state = runner.state("second", prompt=prompts[1])
        state.sync(0, prompts[1])
        assert state.cached == (40 if runner is shared else 0)
        logits = runner.forward([state], [len(state.pending)])[0]
        if runner is shared:
            copied = logits
    torch.testing.assert_close(copied, logits[-len(copied):])


def test_retain_tokens_bounds_what_every_placements_runners_keep(tiny_models, tiny_dirs, prompts, expected) -> None:
    """--retain-tokens reaches the runners of an in-process engine, of Ray workers (their WorkerConfig) and of
    `tandem pools` (the same); 0 keeps nothing, so a repeated prompt is computed whole (and gives the same tokens)."""
    from tandem.cli.common import local_options
    from tandem.cli.main import build_parser
    from tandem.cli.serve import cluster_options
    from tandem.engines.cluster import _worker_common
    from tandem.engines.options import ClusterOptions
    from tandem.workers.worker_base import WorkerConfig, load_runner

    target, draft, _ = tiny_models
    engine = build_engine(target, draft, FIXED_K, retain_tokens=0)
    results = [engine.generate([prompts[0]], GREEDY)[0] for _ in range(2)]
    assert [result.token_ids for result in results] == [expected["greedy"][0]] * 2
    assert results[1].stats["cached_prompt_tokens"] == 0
    assert all(not runner.retained and runner.retain_tokens == 0
               for runner in (engine.verifier.runner, engine.drafter.runner))

    parser = build_parser()
    args = parser.parse_args(["serve", "--target", "t", "--retain-tokens", "5"])
    assert local_options(args).retain_tokens == cluster_options(args).retain_tokens == 5
    assert parser.parse_args(["pools", "start", "--name", "p", "--target", "t"]).retain_tokens == 32768
    assert _worker_common(ClusterOptions(retain_tokens=5), draft=True, threads=None)["retain_tokens"] == 5
    worker = load_runner(WorkerConfig(model=str(tiny_dirs.target), device="cpu", dtype="float32", kv_tokens=4096,
                                      retain_tokens=5))
    assert worker.runner.retain_tokens == 5
    with pytest.raises(Exception, match="retain_tokens: must be non-negative"):
        ClusterOptions(retain_tokens=-1)


def test_a_session_unlike_its_next_prompt_takes_the_longer_prefix_another_holds(tiny_models, prompts) -> None:
    """A session's retained cache serves what of the next prompt it holds; where another sequence's cache holds
    more of that prompt (a shared system prompt after an unrelated turn), the new sequence copies that instead, and
    scores what the whole prompt does."""
    runner, whole = _runner(tiny_models), _runner(tiny_models, prefix_cache=False)
    _finish(runner, "system", prompts[0])
    other = list(range(60, 60 + 30))
    state = runner.state("turn-1", session="s", prompt=other)
    state.sync(0, other)
    runner.prefill(state, len(other))
    runner.release("turn-1", retain=True)
    assert runner.retained_sessions == 1
    state = runner.state("turn-2", session="s", prompt=prompts[1])
    state.sync(0, prompts[1])
    assert state.cached == 40 and runner.shared_tokens == 40
    reference = whole.state("whole", prompt=prompts[1])
    reference.sync(0, prompts[1])
    fed = len(state.pending)
    torch.testing.assert_close(runner.forward([state], [fed])[0],
                               whole.forward([reference], [len(reference.pending)])[0][-fed:])
    runner.release("turn-2", retain=True)  # the session holds the whole second prompt now: more than any other
    longer = prompts[1] + [5, 6]
    state = runner.state("turn-3", session="s", prompt=longer)
    state.sync(0, longer)
    assert state.cached == len(prompts[1]) and runner.shared_tokens == 40  # its own cache, nothing copied
