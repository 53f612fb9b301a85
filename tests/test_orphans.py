"""Which wire ids belong to a dead gateway (the GCS side runs in tests/test_pools.py, a gateway SIGKILLed)."""

from __future__ import annotations

from tandem.workers.orphans import orphans, owner_of


def test_a_wire_id_names_the_job_of_the_gateway_that_sent_it() -> None:
    assert owner_of("job-02000000/3f2a9c1b7d4e/17:req-1") == "02000000"
    assert owner_of("job-02000000/3f2a9c1b7d4e/1/17:req-1") == "02000000"  # a lane's id
    assert owner_of("17:req-1") is None  # `tandem serve`'s own workers: no owner to outlive
    assert owner_of("job-no-slash") is None


def test_only_the_dead_jobs_sequences_are_orphans() -> None:
    held = ["job-01000000/a/0:x", "job-02000000/b/0:y", "job-02000000/b/1:z", "5:plain"]
    assert orphans(held, {"02000000"}) == ["job-02000000/b/0:y", "job-02000000/b/1:z"]
    assert orphans(held, set()) == []
