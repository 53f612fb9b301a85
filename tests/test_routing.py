"""Session routing: running sequences stick, a session's next sequence returns to its cache unless that worker is
too busy, benched workers lose their sequences and sessions."""

from __future__ import annotations

from tandem.workers.routing import AffinityRouter


def test_new_sequences_go_to_the_least_loaded_worker_and_stick() -> None:
    router = AffinityRouter(3, cooldown_s=60, role="draft")
    assert [router.route(f"r{i}") for i in range(4)] == [0, 1, 2, 0]
    assert router.route("r1") == 1
    assert router.group([("r0", ""), ("r1", ""), ("r5", "")]) == {0: [0], 1: [1, 2]}


def test_a_sessions_next_sequence_returns_to_its_worker_within_the_imbalance() -> None:
    router = AffinityRouter(2, cooldown_s=60, role="draft", max_imbalance=2)
    assert router.route("turn-1", "chat") == 0
    router.forget("turn-1", retained=True)
    assert router.sessions["chat"] == 0
    for i in range(2):
        router.route(f"busy-{i}", "")  # worker 0 then 1
    router.route("busy-2", "")  # worker 0 again: 2 running there, 1 on worker 1
    assert router.route("turn-2", "chat") == 0 and router.session_hits == 1
    router.forget("turn-2", retained=False)  # an aborted turn: no cache retained, but the old pin stays
    for i in range(3, 6):
        router.affinity[f"busy-{i}"] = 0  # worker 0 far busier than worker 1
    assert router.route("turn-3", "chat") == 1


def test_benching_a_worker_forgets_its_sequences_and_sessions() -> None:
    router = AffinityRouter(2, cooldown_s=60, role="target")
    router.route("a", "s-a")
    router.forget("a", retained=True)
    router.route("b")
    assert router.bench(0, "failed") == ["b"]
    assert "s-a" not in router.sessions
    assert router.route("c", "s-a") == 1 and router.route("b") == 1
    router.pin("s-x", 7)  # an index this pool does not have (a store written by a larger deployment)
    assert "s-x" not in router.sessions
