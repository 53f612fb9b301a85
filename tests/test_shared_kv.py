"""One KV budget shared by every caller of a pool worker (workers.kv_order): a call that does not fit frees the held
sequences of other callers that come after all of its rows (priority, then arrival), never one ahead of them; a
caller whose one row others keep out waits for them instead of failing, or runs on another replica with room;
freed sequences resend and end with the tokens they would have had alone."""

from __future__ import annotations

import threading
import time

import pytest

from tandem.core.config import EngineConfig, SamplingParams
from tandem.core.engine import SpeculativeEngine
from tandem.core.protocol import DraftRequest, RowOrder, VerifyRequest, WorkerLoad
from tandem.engines.local import build_engine
from tandem.workers.worker_base import WorkerConfig
from telemetry_helpers import scrape, value

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
BUDGET = 96  # KV tokens: one sequence of a 50-token prompt (and its 24 new tokens) fits, two do not
PROMPT = 50


def _prompt(seed: int, count: int = PROMPT) -> list[int]:
    return [(seed * 7919 + i * 104729) % 290 + 3 for i in range(count)]


def test_the_order_frees_the_last_of_the_rows_after_every_row_of_the_call() -> None:
    from tandem.workers.kv_order import HeldOrder

    def row(seq_id: str, priority: int, arrival: float) -> VerifyRequest:
        return VerifyRequest(seq_id, 0, [1], None, GREEDY, order=RowOrder(priority, arrival))

    order = HeldOrder()
    held = [row("a", 0, 1.0), row("b", 3, 2.0), row("c", 3, 0.5), row("d", 1, 9.0)]
    order.note(held, [])
    names = [r.seq_id for r in held] + ["unknown"]  # a sequence no call of this worker's sent: never freed
    call = [row("e", 1, 5.0)]
    order.note(call, names)
    assert order.victim(call, names) == "b"  # priority 3, the later of the two
    assert order.victim(call, ["a", "c", "d", "unknown"]) == "c"
    assert order.victim(call, ["a", "unknown"]) is None and order.others_held(call, ["a", "unknown"])
    assert not order.others_held(call, ["e"])
    mixed = [row("f", 0, 0.1), row("g", 2, 0.1)]  # a call's latest row decides: only what comes after it goes
    order.note(mixed, names)
    assert order.victim(mixed, names) == "b" and order.victim(mixed, ["a", "d"]) is None
    tie = [row("c2", 3, 0.5)]  # same priority and arrival: the id decides
    order.note(tie, names)
    assert order.victim(tie, ["c", "c3"]) is None
    for index in range(200):  # many finished sequences: forgotten, but never the held ones or the call's rows
        fresh = [row(f"new-{index}", 0, 10.0)]
        order.note(fresh, ["b"])
        assert order.victim(fresh, ["b", "new-3"]) == "b"
    assert len(order._ranks) < 100


@pytest.fixture(scope="module")
def target(tiny_dirs):
    from tandem.workers.target_worker import TargetWorker

    return TargetWorker(WorkerConfig(model=str(tiny_dirs.target), device="cpu", dtype="float32", kv_tokens=BUDGET))


def _verify(worker, seq_id: str, order: RowOrder, keep: int = 0, append: list[int] | None = None):
    append = _prompt(len(seq_id)) if append is None else append
    return worker.verify([VerifyRequest(seq_id, keep, append, None, GREEDY, order=order)])


def test_a_full_target_frees_later_rows_of_other_callers_and_only_those(target) -> None:
    background, interactive, newcomer = RowOrder(5, 1.0), RowOrder(0, 2.0), RowOrder(0, 3.0)
    evicted = target.evicted
    metrics = target.serve_metrics(0, "127.0.0.1")
    assert _verify(target, "gw0/background", background).results is not None
    # A request of a lower priority value, from another gateway, that fits only without the background row.
    assert _verify(target, "gw1/interactive", interactive).results is not None
    assert target.evicted == evicted + 1 and set(target.runner.states) == {"gw1/interactive"}
    # The background row's gateway finds it lost, and resent whole it waits: the interactive row is ahead of it.
    assert _verify(target, "gw0/background", background, keep=PROMPT, append=[7]).lost == ["gw0/background"]
    reply = _verify(target, "gw0/background", background)
    assert reply.full is not None and reply.full[2] is True  # ahead: others hold the rest
    # A later arrival of the same priority does not push out an earlier one either.
    reply = _verify(target, "gw2/newcomer", newcomer)
    assert reply.full is not None and reply.full[2] is True and "gw1/interactive" in target.runner.states
    # The earlier one goes on growing.
    assert _verify(target, "gw1/interactive", interactive, keep=PROMPT, append=[9] * 20).results is not None
    assert "gw1/interactive" in target.runner.states and target.evicted == evicted + 1
    families = scrape(metrics)
    assert value(families, "tandem_worker_kv_evictions_total") == target.evicted
    assert value(families, "tandem_worker_state_lost_total") == 1  # the background row's call
    target.release(["gw1/interactive", "gw0/background", "gw2/newcomer"])
    assert target.runner.states == {}


def test_a_row_that_does_not_fit_alone_is_told_nothing_is_ahead(target) -> None:
    reply = _verify(target, "gw0/long", RowOrder(0, 1.0), append=_prompt(1, BUDGET + 10))
    assert reply.full is not None and reply.full[2] is False  # the engine fails it: KVBudgetExceeded
    target.release(["gw0/long"])


def test_a_full_draft_worker_frees_a_later_row_of_another_caller(tiny_dirs) -> None:
    from tandem.workers.draft_worker import DraftWorker

    drafter = DraftWorker(WorkerConfig(model=str(tiny_dirs.draft), device="cpu", dtype="float32", kv_tokens=BUDGET))
    assert drafter.propose([DraftRequest("gw0/late", 0, _prompt(1), 2, GREEDY, order=RowOrder(1, 2.0))]).results
    early = drafter.propose([DraftRequest("gw1/early", 0, _prompt(2), 2, GREEDY, order=RowOrder(1, 1.0))])
    assert early.results is not None and set(drafter.runner.states) == {"gw1/early"} and drafter.info()["evicted"] == 1


def _start_replica(tiny_dirs, kv_tokens: int = BUDGET):
    """One tiny target replica as a Ray actor, with a KV budget of `kv_tokens`."""
    from tandem.workers.target_pool import start_target_replicas

    (replica,) = start_target_replicas(WorkerConfig(model=str(tiny_dirs.target), dtype="float32", threads=1,
                                                    kv_tokens=kv_tokens), count=1)
    return replica


def _module_replica(ray_session, tiny_dirs):
    replica = _start_replica(tiny_dirs)
    yield replica
    ray_session.kill(replica)


@pytest.fixture(scope="module")
def shared_replica(ray_session, tiny_dirs):
    yield from _module_replica(ray_session, tiny_dirs)


def _gateway(tiny_models, replicas, name: str, config: EngineConfig | None = None) -> SpeculativeEngine:
    """A plain-decoding engine over the shared replica(s), as one gateway's: its own wire-id prefix."""
    from tandem.workers.target_pool import RayVerifier

    local = build_engine(tiny_models[0], None, EngineConfig(calibrate=False))
    replicas = replicas if isinstance(replicas, list) else [replicas]
    return SpeculativeEngine(RayVerifier(replicas, prefix=f"{name}-"), None, config or EngineConfig(calibrate=False),
                             local.eos_token_ids, local.decode)


def _evicted(replica) -> int:
    import ray

    return ray.get(replica.info.remote())["evicted"]


@pytest.mark.parametrize("background_priority", [7, 0], ids=["lower-priority", "same-priority"])
def test_two_gateways_on_one_full_replica_both_finish_with_their_tokens_alone(tiny_models, shared_replica,
                                                                             background_priority) -> None:
    """A gateway's request that holds the replica's whole budget, and another gateway's that arrives later. Of a
    lower priority, the first is freed for the second and resumes when it is done; of the same, the second waits. No
    request fails (before, the second failed as if it could never fit), and each ends with its tokens alone."""
    alone = build_engine(tiny_models[0], None, EngineConfig(calibrate=False))
    prompts = {"background": _prompt(3), "interactive": _prompt(4)}
    expected = {name: result.token_ids for name, result in
                zip(prompts, alone.generate(list(prompts.values()), GREEDY), strict=True)}
    gateways = {name: _gateway(tiny_models, shared_replica, name) for name in prompts}
    tokens: dict[str, list[int]] = {name: [] for name in prompts}
    finished: dict[str, object] = {}

    def run(name: str) -> None:
        engine = gateways[name]
        try:
            while engine.has_unfinished():
                for out in engine.step():
                    tokens[name] += out.new_token_ids
            finished[name] = time.perf_counter()
        except Exception as exc:  # the assertion below names what stopped a gateway
            finished[name] = exc

    gateways["background"].add_request(prompts["background"], GREEDY, "background", priority=background_priority)
    for _ in range(3):  # the background request holds its prompt and a few tokens
        tokens["background"] += [t for out in gateways["background"].step() for t in out.new_token_ids]
    gateways["interactive"].add_request(prompts["interactive"], GREEDY, "interactive")
    evicted = _evicted(shared_replica)
    threads = [threading.Thread(target=run, args=(name,)) for name in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert all(isinstance(at, float) for at in finished.values()) and len(finished) == 2, finished
    assert tokens == expected
    if background_priority:  # freed for the interactive request, which finished first
        assert finished["interactive"] < finished["background"] and _evicted(shared_replica) > evicted
    else:  # the interactive request arrived later: it waited
        assert finished["background"] < finished["interactive"] and _evicted(shared_replica) == evicted


def test_a_gateway_tries_its_waiting_request_again_once_another_gateways_leave_room(tiny_models, tiny_dirs,
                                                                                 ray_session) -> None:
    """Gateway B runs x and y beside gateway A's earlier request on one replica; when the budget fills, y waits. Once
    A's request ends there is room for y beside x, which B's engine learns only by trying again (nothing of its own
    finished): y then runs and ends long before x does. Each ends with its tokens alone. The gateways step in turn on
    one thread, so the order is the same every run."""
    replica = _start_replica(tiny_dirs, kv_tokens=200)
    try:
        long, short = (SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (100, 8))
        requests = {"a": (_prompt(5, 60), GREEDY), "x": (_prompt(6, 10), long), "y": (_prompt(7, 10), short)}
        alone = build_engine(tiny_models[0], None, EngineConfig(calibrate=False))
        expected = {name: alone.generate([prompt], params)[0].token_ids for name, (prompt, params) in requests.items()}
        gateways = {"A": _gateway(tiny_models, replica, "A"), "B": _gateway(tiny_models, replica, "B")}
        for name, (prompt, params) in requests.items():
            gateways["A" if name == "a" else "B"].add_request(prompt, params, name)
        tokens: dict[str, list[int]] = {name: [] for name in requests}
        ended: list[str] = []
        for _ in range(2000):
            if not any(engine.has_unfinished() for engine in gateways.values()):
                break
            for engine in gateways.values():
                for out in engine.step() if engine.has_unfinished() else ():
                    tokens[out.request_id] += out.new_token_ids
                    if out.finish_reason is not None:
                        ended.append(out.request_id)
        assert tokens == expected
        assert ended == ["a", "y", "x"] and gateways["B"].preemptions["kv"] + _evicted(replica) > 0  # y did wait
    finally:
        ray_session.kill(replica)


@pytest.fixture(scope="module")
def second_replica(ray_session, tiny_dirs):
    yield from _module_replica(ray_session, tiny_dirs)


def _home_on(replica: int, nth: int = 0) -> str:
    """The `nth` session whose rendezvous rank puts `replica` first (the pool names its replicas target-0,
    target-1)."""
    from tandem.workers.routing import rendezvous_score

    homed = (session for session in (f"chat-{n}" for n in range(100))
             if rendezvous_score(session, f"target-{replica}") > rendezvous_score(session, f"target-{1 - replica}"))
    return [next(homed) for _ in range(nth + 1)][-1]


def _run_in_turn(gateways: dict, tokens: dict, ended: list) -> None:
    for _ in range(200):
        for engine in gateways.values():
            for out in engine.step() if engine.has_unfinished() else ():
                tokens[out.request_id] += out.new_token_ids
                if out.finish_reason is not None:
                    ended.append(out.request_id)
        if not any(engine.has_unfinished() for engine in gateways.values()):
            break


def test_a_new_request_that_a_full_replica_keeps_out_runs_on_another_with_room(tiny_models, shared_replica,
                                                                             second_replica, monkeypatch) -> None:
    """Gateway A's request fills a replica; gateway B's, of the same priority and later, belongs there (its
    session's home), and B last heard both replicas idle (just before A's request came: what it heard stays fresh
    here, so B does not ask again and places by it). That replica says others fill it, so B's client routes the
    request to the other at its next try, under a new wire id, where it runs at once and ends before A's (without the
    spill it waited for A's to end)."""
    from tandem.workers import routing

    monkeypatch.setattr(routing, "LOAD_FRESH_S", 3600.0)
    short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    requests = {"a": (_prompt(8), GREEDY), "b": (_prompt(9), short)}
    alone = build_engine(tiny_models[0], None, EngineConfig(calibrate=False))
    expected = {name: alone.generate([prompt], params)[0].token_ids for name, (prompt, params) in requests.items()}
    gateways = {name: _gateway(tiny_models, [shared_replica, second_replica], name.upper()) for name in requests}
    tokens: dict[str, list[int]] = {name: [] for name in requests}
    ended: list[str] = []
    gateways["a"].add_request(*requests["a"], "a")
    for _ in range(3):
        tokens["a"] += [t for out in gateways["a"].step() for t in out.new_token_ids]
    full = gateways["a"].verifier.router.affinity["a"]
    for index in range(2):
        gateways["b"].verifier.router.observe(index, WorkerLoad(0, capacity=BUDGET))
    gateways["b"].add_request(*requests["b"], "b", session_id=_home_on(full))
    ids, wires = gateways["b"].verifier.ids, []

    def to_wire(seq_id: str, named=ids.to_wire) -> str:  # the wire ids B's calls name
        wires.append(named(seq_id))
        return wires[-1]

    monkeypatch.setattr(ids, "to_wire", to_wire)
    _run_in_turn(gateways, tokens, ended)
    assert tokens == expected and ended == ["b", "a"]
    assert gateways["b"].verifier.router.full_until[full] > 0  # the full replica did turn it away
    # The spilled request runs elsewhere under a new wire id: the release sent to the full replica names the old one.
    assert len(dict.fromkeys(wires)) == 2, wires


def _wait_idle(replicas: list) -> None:
    """Until the replicas hold no sequence (earlier tests' releases are asynchronous)."""
    import ray

    deadline = time.monotonic() + 30
    while any(ray.get([r.cached_sequences.remote() for r in replicas])):
        assert time.monotonic() < deadline, "the replicas still hold sequences"
        time.sleep(0.05)


def test_gateways_sharing_replicas_place_new_requests_by_every_gateways_load(tiny_models, shared_replica,
                                                                             second_replica) -> None:
    """Gateway A runs a short request on one replica (both idle: its own order breaks the tie). Gateway B, with no
    sequence of its own, asks the replicas what they hold before placing its request, and places it on the other;
    before, each gateway counted its own sequences alone, and B's went beside A's whenever B's order put that
    replica first, while the other idled. Both end with their tokens alone."""
    replicas = [shared_replica, second_replica]
    _wait_idle(replicas)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = {"a": _prompt(10, 20), "b": _prompt(11, 20)}
    alone = build_engine(tiny_models[0], None, EngineConfig(calibrate=False))
    expected = {name: alone.generate([prompt], params)[0].token_ids for name, prompt in prompts.items()}
    gateways = {name: _gateway(tiny_models, replicas, name.upper()) for name in prompts}
    tokens: dict[str, list[int]] = {name: [] for name in prompts}
    for name, engine in gateways.items():
        engine.add_request(prompts[name], params, name)
        tokens[name] += [t for out in engine.step() for t in out.new_token_ids]
    placed = gateways["a"].verifier.router.affinity["a"]
    assert gateways["b"].verifier.router.affinity == {"b": 1 - placed}
    _run_in_turn(gateways, tokens, [])
    assert tokens == expected


def test_a_new_request_goes_to_the_replica_whose_kv_budget_holds_it(tiny_models, shared_replica,
                                                                    second_replica) -> None:
    """Gateway A runs a long request on one replica and two short ones on the other (their sessions' home). Gateway
    B's request of 20 tokens fits only beside the short ones (a slot per sequence, as long as the longest): what the
    replicas say they hold (their longest sequence, their budget) places it there at once, and it has its first
    token from its first step. Counting sequences alone, B sent it to the replica that holds one, was turned away
    there (A's request is ahead of it) and tried the other a step later. All end with their tokens alone."""
    replicas = [shared_replica, second_replica]
    _wait_idle(replicas)
    short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    requests = {"a": (_prompt(12), GREEDY, _home_on(0)), "c1": (_prompt(13, 10), short, _home_on(1)),
                "c2": (_prompt(14, 10), short, _home_on(1, 1)), "b": (_prompt(15, 20), short, "")}
    alone = build_engine(tiny_models[0], None, EngineConfig(calibrate=False))
    expected = {name: alone.generate([prompt], params)[0].token_ids for name, (prompt, params, _) in requests.items()}
    gateways = {name: _gateway(tiny_models, replicas, name) for name in ("A", "B")}
    tokens: dict[str, list[int]] = {name: [] for name in requests}
    for name, (prompt, params, session) in requests.items():
        if name != "b":
            gateways["A"].add_request(prompt, params, name, session_id=session)
    for _ in range(3):  # the long request holds its prompt and a few tokens, the short ones their prompts
        for out in gateways["A"].step():
            tokens[out.request_id] += out.new_token_ids
    assert gateways["A"].verifier.router.affinity == {"a": 0, "c1": 1, "c2": 1}
    gateways["B"].add_request(*requests["b"][:2], "b")
    tokens["b"] += [t for out in gateways["B"].step() for t in out.new_token_ids]
    router = gateways["B"].verifier.router
    assert router.affinity == {"b": 1} and tokens["b"] and router.full_until == [0.0, 0.0]
    _run_in_turn(gateways, tokens, [])
    assert tokens == expected


def test_a_long_prompt_goes_in_chunks_while_another_gateways_sequence_runs_on_its_replica(tiny_models, tiny_dirs,
                                                                                        ray_session) -> None:
    """Gateway A's lone 150-token prompt, capped at 40 tokens a step, waits for nothing of A's own; but gateway B's
    sequence decoding on the same replica waits on each of A's forwards. Once the replica has said so (A's first
    reply), A cuts the prompt into its prefill chunks of 16, as if B's sequence decoded in A's own engine: its first
    token comes in step 8 (40, then 16 a step, then the last 14 with its first round) instead of step 4 (40 a step),
    as it does once the replica has said that B's has ended. Both end with their tokens alone."""
    replica = _start_replica(tiny_dirs, kv_tokens=1024)
    try:
        _long_prompt_beside_another_gateway(tiny_models, replica)
    finally:
        ray_session.kill(replica)


def _long_prompt_beside_another_gateway(tiny_models, shared_replica) -> None:
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    longer = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    prompts = {"a": _prompt(21, 150), "b": _prompt(22, 12), "a2": _prompt(23, 150)}  # a2: none of it cached
    alone = build_engine(tiny_models[0], None, EngineConfig(calibrate=False))
    expected = {name: alone.generate([prompt], longer if name == "b" else short)[0].token_ids
                for name, prompt in prompts.items()}
    gateway_a = _gateway(tiny_models, shared_replica, "A",
                         EngineConfig(calibrate=False, max_prefill_tokens=40, prefill_chunk=16))
    gateway_b = _gateway(tiny_models, shared_replica, "B")
    b_tokens: list[int] = []

    def step(engine) -> list[int]:
        return [t for out in engine.step() for t in out.new_token_ids] if engine.has_unfinished() else []

    def first_token_step(request_id: str, prompt: list[int], beside=None) -> tuple[int, list[int]]:
        gateway_a.add_request(prompt, short, request_id)
        tokens, first = [], 0
        for number in range(1, 40):
            if beside is not None:
                b_tokens.extend(step(beside))
            tokens += step(gateway_a)
            first = first or (number if tokens else 0)
            if not gateway_a.has_unfinished():
                return first, tokens
        raise AssertionError("gateway A did not finish")

    gateway_b.add_request(prompts["b"], longer, "b")
    b_tokens += step(gateway_b)
    assert first_token_step("a1", prompts["a"], beside=gateway_b) == (8, expected["a"])
    while gateway_b.has_unfinished():
        b_tokens += step(gateway_b)
    assert b_tokens == expected["b"]
    _wait_idle([shared_replica])
    first_token_step("refresh", prompts["b"])  # a reply that says B's sequence is gone
    assert first_token_step("a2", prompts["a2"]) == (4, expected["a2"])


def test_one_request_id_on_two_gateways_is_two_sequences_on_their_shared_replica(tiny_models, shared_replica) -> None:
    """Gateways that share no request registry (no shared Redis) may both run a request named "same": each gateway's
    wire-id prefix keeps the two apart on the worker, and each ends with its own prompt's tokens."""
    _wait_idle([shared_replica])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = {"a": _prompt(30, 12), "b": _prompt(31, 14)}
    alone = build_engine(tiny_models[0], None, EngineConfig(calibrate=False))
    expected = {name: alone.generate([prompt], params)[0].token_ids for name, prompt in prompts.items()}
    gateways = {name: _gateway(tiny_models, shared_replica, name.upper()) for name in prompts}
    for name, engine in gateways.items():
        engine.add_request(prompts[name], params, "same")
    tokens = {name: [] for name in prompts}
    for _ in range(40):
        for name, engine in gateways.items():
            tokens[name] += [t for out in engine.step() for t in out.new_token_ids] if engine.has_unfinished() else []
    assert tokens == expected
