"""Session routing: running sequences stick, a session's next sequence returns to its cache unless that worker is
too busy, benched workers lose their sequences and sessions."""

from __future__ import annotations

from tandem.core.config import SamplingParams
from tandem.core.protocol import DraftProposal, DraftRequest, VerifyRequest, WorkerLoad
from tandem.workers.routing import AffinityRouter, routing_tokens


def test_new_sequences_go_to_the_least_loaded_worker_and_stick() -> None:
    router = AffinityRouter(3, cooldown_s=60, role="draft")
    assert [router.route(f"r{i}") for i in range(4)] == [0, 1, 2, 0]
    assert router.route("r1") == 1
    assert router.group([("r0", "", 0), ("r1", "", 0), ("r5", "", 0)]) == {0: [0], 1: [1, 2]}


def test_a_sessions_next_sequence_returns_to_its_worker_within_the_imbalance() -> None:
    router = AffinityRouter(2, cooldown_s=60, role="draft", max_imbalance=2)
    home = router.route("turn-1", "chat")
    router.forget("turn-1", retained=True)
    assert router.sessions["chat"] == home
    for i in range(3):
        router.affinity[f"busy-{i}"] = home if i < 2 else 1 - home  # 2 running on home, 1 on the other
    assert router.route("turn-2", "chat") == home and router.session_hits == 1
    router.forget("turn-2", retained=False)  # an aborted turn: no cache retained, but the old pin stays
    for i in range(3, 6):
        router.affinity[f"busy-{i}"] = home  # home far busier than the other worker
    assert router.route("turn-3", "chat") == 1 - home


def test_benching_a_worker_forgets_its_sequences_and_sessions() -> None:
    router = AffinityRouter(2, cooldown_s=60, role="target")
    home = router.route("a", "s-a")
    router.forget("a", retained=True)
    router.route("b")
    router.affinity["b"] = home
    assert router.bench(home, "failed") == ["b"]
    assert "s-a" not in router.sessions
    assert router.route("c", "s-a") == 1 - home and router.route("b") == 1 - home
    router.pin("s-x", 7)  # an index this pool does not have (a store written by a larger deployment)
    assert "s-x" not in router.sessions


def test_rendezvous_placement_is_the_same_in_every_router_and_moves_only_the_removed_workers_sessions() -> None:
    from tandem.workers.routing import AffinityRouter

    names = ["target-0", "target-1", "target-2"]
    first, second = (AffinityRouter(3, 10.0, "target", max_imbalance=10**6, names=names) for _ in range(2))
    sessions = [f"session-{i}" for i in range(60)]
    placed = {s: first.route(f"a/{s}", s) for s in sessions}
    assert placed == {s: second.route(f"b/{s}", s) for s in sessions}, "gateways must agree without talking"
    assert len(set(placed.values())) == 3
    smaller = AffinityRouter(2, 10.0, "target", max_imbalance=10**6, names=["target-0", "target-2"])
    moved = {s: smaller.route(f"c/{s}", s) for s in sessions}
    for session, index in placed.items():
        if names[index] != "target-1":
            assert smaller.names[moved[session]] == names[index], "a session of a remaining worker moved"


def test_resize_keeps_running_sequences_on_their_worker_and_drops_those_of_a_removed_one() -> None:
    from tandem.workers.routing import AffinityRouter

    router = AffinityRouter(2, 10.0, "draft")
    where = {seq: router.route(seq) for seq in ("x", "y", "z", "w")}
    router.resize(["draft-1", "draft-2"])
    for seq, index in where.items():
        if index == 1:
            assert router.affinity[seq] == 0  # draft-1 now at index 0
        else:
            assert seq not in router.affinity
    assert router.size == 2 and router.names == ["draft-1", "draft-2"]


def test_an_overloaded_worker_spills_new_sequences_to_the_next_in_rank() -> None:
    from tandem.workers.routing import AffinityRouter

    router = AffinityRouter(2, 10.0, "target", max_imbalance=1)
    picks = [router.route(f"seq-{i}", "one-busy-session") for i in range(10)]
    assert min(picks.count(0), picks.count(1)) >= 4, picks


def test_new_sequences_sharing_a_long_prompt_prefix_meet_on_one_worker() -> None:
    """Without a session, a prompt longer than PREFIX_ROUTE_TOKENS is placed by its first tokens and its scope, so
    requests sharing a system prompt find it in one worker's prefix cache; every router ranks alike."""
    from tandem.core.protocol import VerifyRequest
    from tandem.workers.routing import PREFIX_ROUTE_TOKENS, routing_key

    system = list(range(1000, 1000 + PREFIX_ROUTE_TOKENS))

    def request(seq_id: str, tail: list[int], scope: str = "", keep: int = 0, session: str = "") -> VerifyRequest:
        return VerifyRequest(seq_id, keep, system + tail, None, None, session=session, cache_scope=scope)

    assert routing_key(request("a", [1])) == routing_key(request("b", [2, 3])) != ""
    assert routing_key(request("a", [1], scope="alice")) != routing_key(request("a", [1], scope="bob"))
    assert routing_key(request("a", [1], session="chat")) == "chat"  # a session's worker comes first
    assert routing_key(request("a", [], keep=4)) == ""  # a running sequence sticks to its worker anyway
    short = VerifyRequest("s", 0, system[:PREFIX_ROUTE_TOKENS], None, None)
    assert routing_key(short) == ""  # no longer than the routed head: the least loaded worker

    placed = set()
    for gateway in range(3):  # three gateways' routers, each with other sequences running
        router = AffinityRouter(4, cooldown_s=60, role="target", names=[f"w{i}" for i in range(4)])
        router.affinity.update({f"other-{i}": i % 4 for i in range(gateway)})
        placed |= {router.route(f"q{n}", routing_key(request(f"q{n}", [n]))) for n in range(2)}
    assert len(placed) == 1


def test_a_worker_other_callers_filled_gives_up_its_new_rows_and_new_ones_avoid_it_a_while() -> None:
    router = AffinityRouter(2, cooldown_s=60, role="target")
    assert router.route("held") == 0 and router.route("new") == 1
    router.mark_full(1, ["new"])
    assert "new" not in router.affinity
    # Routed afresh, and every new sequence, sessions' included, goes to the other worker while the mark lasts...
    assert [router.route(seq_id) for seq_id in ("new", "b", "c")] == [0, 0, 0]
    router.pin("chat", 1)
    assert router.route("turn", "chat") == 0 and router.route("held") == 0  # a running one stays where it is
    router.mark_full(0, [])
    assert router.route("d") in (0, 1)  # both full: routed as usual
    router.full_until = [0.0, 0.0]  # the marks lapse (FULL_AVOID_S)
    assert router.route("e") == 1  # the least loaded again


def test_other_callers_sequences_count_in_a_workers_load_as_it_last_said() -> None:
    router = AffinityRouter(3, cooldown_s=60, role="target", names=["w0", "w1", "w2"])
    assert router.unheard() == []  # a private pool's one caller: nobody else's load to ask
    assert router.route("mine") == 0
    router.observe(0, WorkerLoad(3))  # mine and two of other gateways'
    router.observe(1, WorkerLoad(1))
    assert router.others == [2, 1, 0]
    assert [router.route(f"n{i}") for i in range(3)] == [2, 1, 2]  # by every caller's load: 3, 1, 0 to begin
    router.observe(2, WorkerLoad(1))  # only my two, as it says: none of others' (never below 0)
    assert router.others[2] == 0
    # A session's home is still its rank's first worker unless that one is busier by more than the imbalance.
    router.observe(0, WorkerLoad(1 + 5))
    assert router.route("turn", "s") != 0
    router.share("gw/")  # other gateways call these workers: those not heard from lately are asked
    assert router.unheard() == []  # all three said just now
    router.resize(["w2", "w0"])  # others' counts follow the names; a changed pool is heard afresh
    assert router.others == [0, 5] and sorted(router.unheard()) == [0, 1]
    assert router.unheard() == []  # asked: not asked again at once
    lone = AffinityRouter(1, cooldown_s=60, role="draft")
    lone.share("gw/")
    assert lone.unheard() == []  # one worker: nothing to choose


def test_each_gateway_breaks_ties_in_an_order_of_its_own() -> None:
    """Requests arriving at many gateways in the same instant, every worker idle: each gateway's first pick follows
    its own key (its wire-id prefix), so they spread instead of all taking the first worker."""
    names = [f"target-{i}" for i in range(4)]
    firsts = set()
    for gateway in range(16):
        router = AffinityRouter(4, cooldown_s=60, role="target", names=names)
        router.share(f"gateway-{gateway}/")
        firsts.add(router.route("r0"))
        assert sorted(router.route(f"r{i}") for i in range(1, 4)) == sorted({0, 1, 2, 3} - {router.affinity["r0"]})
    assert len(firsts) >= 3
    router.resize(names[:2])  # the order is kept for the workers that stayed
    assert router.shared_as == "gateway-15/" and len(router._tie_rank) == 2


def test_a_new_sequence_goes_where_its_length_fits_the_kv_budget_as_the_worker_said() -> None:
    """Worker 0 runs one long sequence, worker 1 two short ones (every caller's), both under a budget of 96 tokens,
    a slot per sequence as long as the longest. By sequences worker 0 is the least loaded, but a 20-token sequence
    fits only beside worker 1's. Among workers it fits (or where none does) a sequence goes where it would fill the
    smallest share of the budget: beside sequences of its own length rather than in a slot as long as another's."""
    router = AffinityRouter(2, cooldown_s=60, role="target", names=["w0", "w1"])
    router.share("gw/")
    router.observe(0, WorkerLoad(1, longest=53, capacity=96))
    router.observe(1, WorkerLoad(2, longest=11, capacity=96))
    assert router.route("long", tokens=21) == 1  # 2 x 53 > 96 on worker 0; 3 x 21 <= 96 on worker 1
    assert router.route("short", tokens=0) == 1  # with the short ones: 4 x 11 of 96 against 2 x 53
    assert router.route("next", tokens=40) == 0  # fits nowhere: where it fills the least (2 x 53 against 5 x 40)
    assert router.route("turn", "chat", tokens=21) == 1  # a session's rank gives way too
    router.observe(0, WorkerLoad(0, capacity=96))  # worker 0's long sequence ended
    router.loads[1] = None  # a worker not heard from: its room is not judged
    assert router.route("again", tokens=60) in (0, 1)


def test_a_rows_routing_tokens_are_its_sequence_as_long_as_the_row_makes_it() -> None:
    greedy = SamplingParams(temperature=0.0)
    assert routing_tokens(DraftRequest("d", 4, [1, 2], 3, greedy)) == 4 + 2 + 1 + 3
    assert routing_tokens(VerifyRequest("v", 0, [1, 2, 3], DraftProposal([5, 6]), greedy)) == 3 + 1 + 2
    assert routing_tokens(VerifyRequest("v", 2, [1], None, greedy)) == 2 + 1 + 1
