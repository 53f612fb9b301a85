"""The runner's preallocated KV cache: in-place writes give the logits a full recomputation gives, rollback is a
length, steady decoding never moves or copies the cache, and a token budget admits, evicts and refuses."""

from __future__ import annotations

import inspect
import pickle
import threading
import warnings

import psutil
import pytest
import torch
from torch.nn.attention import SDPBackend

from tandem.bench.allocations import AllocationMeter
from tandem.core.kv_cache import CPU_SHARE, HOST_WORKERS_ENV, cache_keyword, default_kv_tokens, kv_bytes_per_token
from tandem.core.protocol import KVCacheFull
from tandem.core.runner import ModelRunner
from tandem.errors import KVBudgetExceeded

TIGHT = {"rtol": 1e-5, "atol": 1e-5}


def _tokens(seed: int, count: int) -> list[int]:
    return torch.randint(3, 300, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def _recomputed(model, tokens: list[int], want: int) -> torch.Tensor:
    """The model over the whole sequence with no cache at all."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0, len(tokens) - want :].float()


def _alone(model, tokens: list[int], cached: int, want: int) -> torch.Tensor:
    runner = ModelRunner(model, kv_tokens=4096)
    state = runner.state("alone")
    state.sync(0, tokens)
    runner.prefill(state, cached)
    return runner.forward([state], [want])[0]


def test_rows_of_different_lengths_and_widths_match_each_row_alone_and_a_full_recomputation(tiny_models) -> None:
    model = tiny_models[0].model
    runner = ModelRunner(model, kv_tokens=4096)
    # (cached, new) per row; row 2 starts uncached, row 3 is between the others but sits this forward out.
    shapes = [(3, 1), (17, 4), (0, 6), (11, 2), (9, 3)]
    sequences = [_tokens(i, cached + new) for i, (cached, new) in enumerate(shapes)]
    states = []
    for i, ((cached, _), tokens) in enumerate(zip(shapes, sequences, strict=True)):
        state = runner.state(f"s{i}")
        state.sync(0, tokens)
        runner.prefill(state, cached)
        states.append(state)
    taking_part = [0, 4, 2, 1]  # not in slot order
    wants = [1, 3, 6, 2]
    batched = runner.forward([states[i] for i in taking_part], wants)
    for i, want, logits in zip(taking_part, wants, batched, strict=True):
        cached, new = shapes[i]
        assert logits.shape == (want, runner.vocab_size) and states[i].cached == cached + new
        torch.testing.assert_close(logits, _alone(model, sequences[i], cached, want), **TIGHT)
        torch.testing.assert_close(logits, _recomputed(model, sequences[i], want), **TIGHT)
    assert states[3].cached == shapes[3][0]  # the row that sat out wrote nothing
    torch.testing.assert_close(runner.forward([states[3]], [2])[0], _recomputed(model, sequences[3], 2), **TIGHT)


def test_the_runner_passes_its_cache_by_the_name_the_installed_transformers_takes(tiny_models) -> None:
    """transformers 5.24 renamed the forward's `past_key_values` to `cache` and drops the old name in 5.40: a
    runner's forwards name the cache as the installed release declares it, and raise no deprecation warning."""
    model = tiny_models[0].model
    keyword = cache_keyword(model.base_model)
    assert keyword in {"cache", "past_key_values"} & set(inspect.signature(model.base_model.forward).parameters)
    runner = ModelRunner(model, kv_tokens=1024)
    state = runner.state("named")
    state.sync(0, _tokens(5, 12))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner.prefill(state, 11)
        logits = runner.forward([state], [1])[0]
    assert not [w for w in caught if "past_key_values" in str(w.message)]
    torch.testing.assert_close(logits, _recomputed(model, state.tokens, 1), **TIGHT)


def test_rollback_then_reextend_equals_a_fresh_run(tiny_models) -> None:
    model = tiny_models[0].model
    runner = ModelRunner(model, kv_tokens=4096)
    prompt, rejected, accepted = _tokens(1, 20), _tokens(2, 5), _tokens(3, 3)
    other = runner.state("other")
    other.sync(0, _tokens(4, 30))
    state = runner.state("a")
    state.sync(0, prompt + rejected)
    runner.forward([other, state], [1, 5])
    state.sync(len(prompt) + 1, accepted)  # keeps the first drafted token, rolls back four
    assert state.cached == len(prompt) + 1
    other.tokens.append(7)
    rolled = runner.forward([state, other], [3, 1])
    expected = prompt + rejected[:1] + accepted
    torch.testing.assert_close(rolled[0], _recomputed(model, expected, 3), **TIGHT)
    torch.testing.assert_close(rolled[1], _recomputed(model, other.tokens, 1), **TIGHT)


def test_released_and_retained_sequences_keep_their_keys_when_slots_move(tiny_models) -> None:
    model = tiny_models[0].model
    runner = ModelRunner(model, kv_tokens=4096)
    sequences = {name: _tokens(i, 12 + i) for i, name in enumerate("abcd")}
    for name, tokens in sequences.items():
        state = runner.state(name, session=f"chat-{name}")
        state.sync(0, tokens)
        runner.prefill(state, len(tokens) - 1)
    runner.release("a", retain=True)  # d moves into a's slot, a is kept above the active ones
    runner.release("b")
    assert sorted(s.slot for s in runner.states.values()) == [0, 1]
    resumed = runner.state("a2", session="chat-a")
    assert resumed.cached == len(sequences["a"]) - 1 and resumed.slot == 2
    states = [runner.states[name] for name in ("c", "d", "a2")]
    logits = runner.forward(states, [1, 1, 1])
    for name, row in zip("cda", logits, strict=True):
        torch.testing.assert_close(row, _recomputed(model, sequences[name], 1), **TIGHT)


def _decode(runner: ModelRunner, states, steps: int) -> list[int]:
    pointers = []
    for _ in range(steps):
        logits = runner.forward(states, [1] * len(states))
        for state, row in zip(states, logits, strict=True):
            state.tokens.append(int(row[-1].argmax()))
        pointers.append([t.data_ptr() for layer in runner.cache.layers for t in (layer.keys, layer.values)])
    return pointers


def test_a_capacity_left_by_a_long_sequence_shrinks_once_it_is_gone(tiny_models) -> None:
    """A GPU's graphs read every position of the buffers, so a capacity a finished long sequence left would cost
    every later step: the first forward after it has gone shrinks the cache, and what the others hold is kept. A
    retained session's sequence, or a new long prompt, is held, so nothing shrinks under it."""
    model = tiny_models[0].model
    runner = ModelRunner(model, kv_tokens=65536)
    kept = runner.state("kept", session="chat")
    kept.sync(0, _tokens(0, 1200))
    runner.prefill(kept, 1200)
    runner.release("kept", retain=True)
    short = runner.state("short")
    short.sync(0, _tokens(1, 40))
    runner.prefill(short, 39)
    logits = runner.forward([short], [1])[0]
    assert runner.cache.capacity >= 1200  # the retained session still holds its 1200 tokens
    assert runner.state("back", session="chat").cached == 1200  # the session returns to its cache ...
    runner.release("back")  # ... and ends without keeping it
    short.sync(len(short.tokens), [int(logits[-1].argmax())])
    again = runner.forward([short], [1])[0]
    assert runner.cache.capacity == 256 and runner.kv_tokens_reserved == runner.cache.slots * 256
    torch.testing.assert_close(again, _recomputed(model, short.tokens, 1), **TIGHT)
    long = runner.state("long")
    long.sync(0, _tokens(2, 1100))
    runner.prefill(long, 1100)  # grows straight to what the prompt needs, with nothing shrunk first
    assert runner.cache.capacity >= 1100


@pytest.mark.parametrize("batch", [1, 4])
def test_steady_decoding_writes_in_place_and_allocates_nothing_that_grows_with_context(tiny_models,
                                                                                       batch: int) -> None:
    model = tiny_models[0].model
    per_step, live = {}, {}
    for context in (40, 400):
        runner = ModelRunner(model, kv_tokens=8192)
        states = []
        for i in range(batch):
            state = runner.state(f"s{i}")
            state.sync(0, _tokens(i, context + 3 * i))  # rows of different lengths
            states.append(state)
        _decode(runner, states, 2)  # prefill, and the capacity the decode needs
        shape = (runner.cache.slots, runner.cache.capacity)
        pointers = _decode(runner, states, 4)
        assert all(p == pointers[0] for p in pointers) and (runner.cache.slots, runner.cache.capacity) == shape
        meter = AllocationMeter()
        with meter:
            _decode(runner, states, 4)
        # Attention's own workspace (scores over the context) is not a copy of the cache.
        per_step[context] = (meter.allocated - meter.by_op["aten::scaled_dot_product_attention"]) / 4
        live[context] = runner.kv_tokens_used * runner.cache.reserved_bytes / runner.kv_tokens_reserved
    copies = (per_step[400] - per_step[40]) / (live[400] - live[40])
    assert copies < 0.02, f"{copies:.3f} copies of the KV cache per step"


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


def test_verifying_several_tokens_per_row_does_not_repeat_the_key_value_heads(tiny_models) -> None:
    model = tiny_models[0].model
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # grouped-query attention
    per_step, live = {}, {}
    for context in (40, 400):
        runner = ModelRunner(model, kv_tokens=8192)
        states = []
        for i in range(3):
            state = runner.state(f"s{i}")
            state.sync(0, _tokens(i, context + 5 * i))
            runner.prefill(state, len(state.tokens) - 1)
            state.tokens.extend([5, 6, 7, 8])
            states.append(state)
        meter = AllocationMeter()
        with meter:
            logits = runner.forward(states, [5, 5, 5])
        for state, row in zip(states, logits, strict=True):
            torch.testing.assert_close(row, _recomputed(model, state.tokens, 5), **TIGHT)
        per_step[context] = meter.allocated - meter.by_op["aten::scaled_dot_product_attention"]
        live[context] = runner.kv_tokens_used  # no retained sessions: the rows' own tokens
    kv_token_bytes = runner.cache.reserved_bytes / runner.kv_tokens_reserved
    copies = (per_step[400] - per_step[40]) / ((live[400] - live[40]) * kv_token_bytes)
    assert copies < 0.05, f"{copies:.3f} copies of the KV cache per step"


@pytest.mark.parametrize("backends", [None, (SDPBackend.MATH,)], ids=["any-kernel", "math-kernel"])
@pytest.mark.parametrize("width", [1, 3])
def test_packed_attention_equals_repeated_key_value_heads(width: int, backends, monkeypatch) -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tandem.core import attention
    from tandem.core.attention import packed_sdpa_forward

    monkeypatch.setattr(attention, "BACKENDS", [backends])  # the kernels the packed call may use

    class Attention(torch.nn.Module):
        num_key_value_groups = 3
        is_causal = True

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 6, width, 8, generator=generator)
    key, value = (torch.randn(2, 2, 11, 8, generator=generator) for _ in range(2))
    mask = torch.rand(2, 1, width, 11, generator=generator) < 0.7
    mask[..., 0] = True
    expected, _ = sdpa_attention_forward(Attention(), query, key, value, mask, scaling=0.3)
    packed, _ = packed_sdpa_forward(Attention().eval(), query, key, value, mask, scaling=0.3)
    torch.testing.assert_close(packed, expected, rtol=1e-6, atol=1e-6)


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


def test_packed_rows_give_what_padded_rows_and_a_full_recomputation_give(tiny_models, monkeypatch) -> None:
    """Rows of different widths fed packed into one row (no padding; attention per row over its own cached keys)
    give each row's logits as padding them does, and write the same keys: later forwards agree too."""
    from tandem.core.row_layout import RowLayout

    model = tiny_models[0].model
    # (cached, new) per row: uncached rows, a cached prefix, a one-token row, and a row between them sitting out.
    shapes = [(0, 9), (5, 3), (0, 1), (12, 6), (7, 0), (3, 11)]
    sequences = [_tokens(10 + i, cached + new + 2) for i, (cached, new) in enumerate(shapes)]
    taking_part = [5, 0, 3, 1, 2]
    wants = [11, 2, 1, 3, 1]
    calls = []
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        _counting(torch.nn.functional.scaled_dot_product_attention, calls))
    results = {}
    for pack in (False, True):
        runner = ModelRunner(model, kv_tokens=4096)
        states = []
        for i, ((cached, new), tokens) in enumerate(zip(shapes, sequences, strict=True)):
            state = runner.state(f"s{i}")
            state.sync(0, tokens[: cached + new])
            runner.prefill(state, cached)
            states.append(state)
        calls.clear()
        monkeypatch.setattr(RowLayout, "packs", lambda self, *shape, pack=pack: pack)
        first = runner.forward([states[i] for i in taking_part], wants)
        fed = len(calls)
        monkeypatch.setattr(RowLayout, "packs", lambda self, *shape, pack=pack: not pack)
        for i in taking_part:  # two more tokens each, through the cache the first forward wrote, the other way
            states[i].sync(states[i].cached, sequences[i][states[i].cached :])
        later = runner.forward([states[i] for i in taking_part], [2] * len(taking_part))
        results[pack] = (first, later, fed)
    (padded, padded_later, padded_calls), (packed, packed_later, packed_calls) = results[False], results[True]
    layers = model.config.num_hidden_layers
    assert padded_calls == layers and packed_calls == len(taking_part) * layers  # one attention call per row
    for i, want, a, b in zip(taking_part, wants, padded, packed, strict=True):
        cached, new = shapes[i]
        torch.testing.assert_close(b, a, **TIGHT)
        torch.testing.assert_close(b, _recomputed(model, sequences[i][: cached + new], want), **TIGHT)
    for i, a, b in zip(taking_part, padded_later, packed_later, strict=True):
        torch.testing.assert_close(b, a, **TIGHT)
        torch.testing.assert_close(b, _recomputed(model, sequences[i], 2), **TIGHT)


def _counting(function, calls: list):
    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return function(*args, **kwargs)
    return counted


def test_rows_are_packed_where_their_padding_would_cost_more_than_an_attention_call_per_row() -> None:
    from tandem.core.row_layout import PACK_AREA, packing_pays

    assert packing_pays("cpu", 8, 48, 27) and packing_pays("cpu", 8, 16, 9)  # verification of uneven drafts
    assert packing_pays("cpu", 8, 480, 413)  # prompts arriving together
    assert not packing_pays("cpu", 8, 40, 39) and not packing_pays("cpu", 8, 8, 8)  # little or no padding
    assert not packing_pays("cpu", 1, 5, 3)  # one row: nothing to pack
    assert not packing_pays("cuda", 8, 48, 27) and packing_pays("cuda", 8, PACK_AREA, 200)  # there, wide ones only


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
