"""The KV cache's token budget: a small one evicts retained sessions then refuses; the engine queues what the
verifier cannot hold (its retried rounds moving each policy once) and names a request that can never fit; a CPU
runner's default budget is a share of the available memory, shared by workers on one host; and usage, reported in
worker info and read from other threads, counts a moving session once."""

from __future__ import annotations

import pickle
import threading

import psutil
import pytest
import torch

from kv_cache_harness import TIGHT, _recomputed, _tokens
from tandem.core.kv_cache import CPU_SHARE, HOST_WORKERS_ENV, default_kv_tokens, kv_bytes_per_token
from tandem.core.protocol import KVCacheFull
from tandem.core.runner import ModelRunner
from tandem.errors import KVBudgetExceeded


def test_a_small_budget_evicts_retained_sessions_then_refuses(tiny_models) -> None:
    model = tiny_models[0].model
    runner = ModelRunner(model, kv_tokens=100)
    first = runner.state("a", session="chat")
    first.sync(0, _tokens(0, 45))
    runner.prefill(first, 44)
    runner.release("a", retain=True)
    assert runner.kv_tokens_used == 44 and runner.kv_tokens_capacity == 100
    second = runner.state("b")
    second.sync(0, _tokens(1, 60))
    runner.prefill(second, 59)  # two slots of 59 do not fit in 100: the retained session goes
    assert not runner.retained and runner.kv_tokens_used == 59
    assert runner.kv_tokens_reserved <= 100
    with pytest.raises(KVCacheFull) as full:
        runner.state("c")  # a second slot as long as b's cannot fit, and nothing is left to evict
    assert full.value.capacity == 100 and "c" not in runner.states
    with pytest.raises(KVCacheFull):
        second.tokens.extend(_tokens(2, 50))
        runner.forward([second], [1])
    assert second.cached == 59  # the refused forward wrote nothing
    del second.tokens[60:]
    torch.testing.assert_close(runner.forward([second], [1])[0], _recomputed(model, second.tokens, 1), **TIGHT)
    restored = pickle.loads(pickle.dumps(full.value))
    assert isinstance(restored, KVCacheFull) and (restored.needed, restored.capacity) == (118, 100)


def test_worker_info_reports_kv_tokens(tiny_dirs) -> None:
    from tandem.workers.draft_worker import DraftWorker
    from tandem.workers.worker_base import WorkerConfig

    info = DraftWorker(WorkerConfig(model=str(tiny_dirs.draft), device="cpu", dtype="float32")).info()
    assert info["kv_tokens_used"] == 0 and info["kv_tokens_capacity"] > 0 and "kv_tokens_reserved" in info


def test_the_engine_queues_what_the_verifier_cannot_hold_and_runs_it_once_room_is_made(tiny_models) -> None:
    from tandem.core.config import EngineConfig, SamplingParams
    from tandem.core.engine import SpeculativeEngine
    from tandem.core.local import LocalVerifier

    model = tiny_models[0].model
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [_tokens(10 + i, 30) for i in range(3)]
    roomy = SpeculativeEngine(LocalVerifier(ModelRunner(model, kv_tokens=4096)), None, EngineConfig(calibrate=False))
    expected = [r.token_ids for r in roomy.generate(prompts, params)]
    # Three 30-token prompts fit in 100 tokens, but not once they have grown past 33 tokens: the newest is
    # preempted, waits, and is recomputed from its history when the others finish.
    runner = ModelRunner(model, kv_tokens=100)
    engine = SpeculativeEngine(LocalVerifier(runner), None, EngineConfig(calibrate=False))
    sequences = [engine.sequences[engine.add_request(p, params)] for p in prompts]
    waited = False
    while engine.has_unfinished():
        engine.step()
        waited |= len(runner.states) == 2 and len(sequences[2].output) < len(sequences[0].output)
        assert runner.kv_tokens_reserved <= 100
    assert waited
    assert [engine.result(seq).token_ids for seq in sequences] == expected


def test_a_round_retried_for_a_smaller_batch_moves_each_policy_once(tiny_models) -> None:
    """A round the verifier cannot hold is planned again without its newest sequence: the policies of the others
    record one round, not one per try (a fallback session's probe clock counts the rounds it ran)."""
    from tandem.core.config import EngineConfig, SamplingParams, SpecConfig
    from tandem.core.costs import CostModel
    from tandem.core.engine import SpeculativeEngine
    from tandem.core.local import LocalDrafter, LocalVerifier
    from tandem.core.policy import PolicyState

    target, draft, _ = tiny_models
    costs = CostModel(draft_step=0.3, verify={n: 1.0 + 0.05 * (n - 1) for n in range(1, 12)}, frozen=True)
    runner = ModelRunner(target.model, kv_tokens=100)  # as above: the third sequence is preempted
    engine = SpeculativeEngine(LocalVerifier(runner), LocalDrafter(ModelRunner(draft.model, kv_tokens=4096)),
                               EngineConfig(spec=SpecConfig(probe_interval=64, probe_interval_max=64),
                                            calibrate=False), costs=costs)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    in_fallback = {"rejected": 50.0, "fallback": True, "probe_interval": 64}  # no probe due within 12 tokens
    sequences = [engine.sequences[engine.add_request(_tokens(10 + i, 30), params,
                                                     policy_state=PolicyState.from_dict(in_fallback))]
                 for i in range(3)]
    waited = False
    while engine.has_unfinished():
        engine.step()
        waited |= len(runner.states) == 2 and len(sequences[2].output) < len(sequences[0].output)
        # The first round is plain without asking the policy; each later round asks it once.
        assert all(seq.policy.rounds_since_probe == max(seq.stats.rounds - 1, 0) for seq in sequences)
    assert waited and all(seq.stats.drafted == 0 for seq in sequences)


def test_a_request_that_can_never_fit_raises_a_clear_error_naming_it(tiny_models) -> None:
    from tandem.core.config import EngineConfig, SamplingParams
    from tandem.core.engine import SpeculativeEngine
    from tandem.core.local import LocalVerifier

    engine = SpeculativeEngine(LocalVerifier(ModelRunner(tiny_models[0].model, kv_tokens=20)), None,
                               EngineConfig(calibrate=False))
    request_id = engine.add_request(_tokens(0, 30), SamplingParams(temperature=0.0, max_tokens=4))
    with pytest.raises(KVBudgetExceeded, match=rf"request {request_id}: .* needs \d+ KV cache tokens, .* 20 "):
        engine.step()


def test_a_cpu_runners_default_budget_is_a_share_of_the_available_memory(tiny_models) -> None:
    """Available, page cache included, not free pages alone (16 of 23 GiB on CPU-A): the two differ by the cache.
    The tolerance leaves room for other processes allocating between the calls."""
    model = tiny_models[0].model
    available = psutil.virtual_memory().available * CPU_SHARE / kv_bytes_per_token(model)
    assert default_kv_tokens(model) == pytest.approx(available, rel=0.05)
    assert ModelRunner(model).kv_tokens_capacity == pytest.approx(available, rel=0.05)


@pytest.mark.parametrize(("workers", "share"), [("1", 1.0), ("2", 1.0), ("4", 0.5), ("6", 1 / 3), ("x", 1.0)])
def test_workers_sharing_a_host_share_its_memory(tiny_models, monkeypatch, workers: str, share: float) -> None:
    """Each worker took a quarter of the host's available memory on its own: two draft workers and two target
    replicas on one host promised it all (measured: about 5.5 GB each on a 23 GiB host)."""
    model = tiny_models[0].model
    monkeypatch.setenv(HOST_WORKERS_ENV, workers)
    available = psutil.virtual_memory().available * CPU_SHARE * share / kv_bytes_per_token(model)
    assert default_kv_tokens(model) == pytest.approx(available, rel=0.05)


def test_kv_usage_read_from_another_thread_counts_a_moving_session_once(tiny_models) -> None:
    """Metrics and info() read kv_tokens_used from their own threads while the model thread releases sequences into
    their sessions' retained caches and resumes them: a state on the move is counted once, never missed."""
    runner = ModelRunner(tiny_models[0].model, kv_tokens=4096)
    for name in "abc":
        state = runner.state(name, session=f"chat-{name}")
        state.sync(0, _tokens(ord(name), 20))
        runner.prefill(state, 19)
    held = runner.kv_tokens_used
    readings: list[int] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            readings.append(runner.kv_tokens_used)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for turn in range(300):  # each move swaps slots (tensor copies, which let the reader run mid-move)
            name = "abc"[turn % 3]
            runner.release(f"{name}{turn // 3}" if turn >= 3 else name, retain=True)
            runner.state(f"{name}{turn // 3 + 1}", session=f"chat-{name}")
    finally:
        done.set()
        reader.join()
    assert len(readings) > 100 and set(readings) == {held}
