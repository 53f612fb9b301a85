"""Canary assignment is keyed with a server secret: a client cannot compute a session's arm (so cannot pick session ids
that land on the candidate), replicas holding the same secret agree on every session, tenants are placed apart, and
the secret comes from a file or the environment and is never logged. Controllers run on a real redis-server."""

from __future__ import annotations

import argparse
import hashlib
import logging
import uuid
from collections import Counter

import pytest
from scipy.stats import binomtest, chisquare

from tandem.canary import CanaryController, CanarySecret, RedisCanaryStore, parse_arms
from tandem.canary import secret as secret_module
from tandem.canary.assignment import choose_arm, ordered, session_key
from tandem.canary.config import options_from_env, start_controller
from tandem.canary.secret import ENV_SECRET, ENV_SECRET_FILE, configured_secret, random_secret
from tandem.cli.canary import add_serve_canary_options, serve_canary_options
from tandem.errors import InvalidArgument
from tandem.sessions import EmbeddedRedis

HALVES = parse_arms('[{"name": "stable", "weight": 50}, {"name": "canary", "draftModel": "d1", "weight": 50}]')
RAMP = parse_arms('[{"name": "stable", "weight": 95}, {"name": "canary", "draftModel": "d1", "weight": 5}]')
SECRET_A = CanarySecret(b"a" * 32, "test A")
SECRET_B = CanarySecret(b"b" * 32, "test B")
IDS = [f"user-{i}" for i in range(200)]


@pytest.fixture(scope="module")
def server():
    with EmbeddedRedis() as embedded:
        yield embedded


def replica(url: str, deployment: str, secret: CanarySecret | None, arms=HALVES) -> CanaryController:
    """One gateway replica's controller, on its own connection to the shared Redis."""
    gateway = CanaryController(RedisCanaryStore(url), deployment, arms=arms, secret=secret)
    gateway.refresh()
    return gateway


def public_prediction(arms, deployment: str, key: str) -> str:
    """What anyone could compute before: sha256(deployment NUL key) against the cumulative weights."""
    digest = hashlib.sha256(f"{deployment}\x00{key}".encode()).digest()
    return choose_arm(ordered(arms, "stable"), int.from_bytes(digest[:8], "big") / float(1 << 64)).name


def arms_of(gateway: CanaryController, ids: list[str], tenant: str = "") -> list[str]:
    return [gateway.arm_for(session, tenant=tenant).arm.name for session in ids]


def test_public_hash_predicts_the_arm_only_at_chance(server) -> None:
    # A fixed deployment name (the Redis server is this module's own): four tests at p 1e-3 over a random name
    # would fail one run in 250 by chance alone.
    name = "assign-public-hash"
    for secret in (SECRET_A, SECRET_B):
        chosen = arms_of(replica(server.url, name, secret), IDS)
        for key_of in (lambda s: "s:" + s, lambda s: session_key(s)):  # the old key, and the new one made public
            hits = sum(public_prediction(HALVES, name, key_of(s)) == arm for s, arm in zip(IDS, chosen, strict=True))
            assert binomtest(hits, len(IDS), 0.5).pvalue > 1e-3, (secret.source, hits)


def test_session_ids_picked_for_the_candidate_land_at_its_weight(server) -> None:
    """The attack: a client keeps the ids the public hash puts on the 5% candidate. Before, all of them landed there;
    with the keyed hash they land there at the candidate's weight, like any other ids."""
    name = "attack"  # fixed, as above: the binomial test's outcome is then the same every run
    picked = [s for s in (f"pick-{i}" for i in range(20_000)) if public_prediction(RAMP, name, "s:" + s) == "canary"]
    picked = picked[:200]
    assert len(picked) == 200
    on_canary = arms_of(replica(server.url, name, SECRET_A, RAMP), picked).count("canary")
    assert binomtest(on_canary, len(picked), 0.05).pvalue > 1e-3 and on_canary < 30, on_canary


def test_same_secret_agrees_across_replicas_other_secrets_do_not(server, tmp_path) -> None:
    name = "replicas"  # fixed, as above, and so is the secret in the file
    path = tmp_path / "canary.secret"
    path.write_text(hashlib.sha256(b"replicas").hexdigest() + "\n")
    first, second = configured_secret(path, {}), configured_secret(path, {})  # two replicas reading the mounted file
    assert first.key == path.read_text().strip().encode()
    a, b = replica(server.url, name, first), replica(server.url, name, second)
    assert arms_of(a, IDS * 5) == arms_of(b, IDS * 5)  # and stable: the same session five times over
    other = replica(server.url, name, SECRET_B)
    agree = sum(x == y for x, y in zip(arms_of(a, IDS), arms_of(other, IDS), strict=True))
    assert binomtest(agree, len(IDS), 0.5).pvalue > 1e-3, agree


def test_weights_honoured_for_a_fixed_secret(server) -> None:
    arms = parse_arms('[{"name": "stable", "weight": 70}, {"name": "canary", "draftModel": "d1", "weight": 20}, '
                      '{"name": "other", "kMax": 2, "weight": 10}]')
    gateway = replica(server.url, "uniform", SECRET_A, arms)  # fixed, as above
    counts = Counter(arms_of(gateway, [f"s{i}" for i in range(20_000)]))
    result = chisquare([counts["stable"], counts["canary"], counts["other"]], [14_000, 4_000, 2_000])
    assert result.pvalue > 1e-3, (counts, result)


def test_the_tenant_is_part_of_the_key(server) -> None:
    # A fixed deployment name and secret fix every assignment: a random name failed this 1-in-1000 test at random.
    gateway = replica(server.url, "tenants-fixed", SECRET_A)
    alice, bob = arms_of(gateway, IDS, "alice"), arms_of(gateway, IDS, "bob")
    assert binomtest(sum(x == y for x, y in zip(alice, bob, strict=True)), len(IDS), 0.5).pvalue > 1e-3
    assert arms_of(gateway, IDS, "alice") == alice  # sticky within a tenant
    assert gateway.arm_for("s1", tenant="alice").tenant == "alice"
    # no (tenant, id) pair spells another's key, whatever the ids hold
    keys = {session_key("b:c", tenant="a"), session_key("c", tenant="a:b"), session_key("a:b:c"),
            session_key("", "b:c", tenant="a"), session_key("c", tenant="a")}
    assert len(keys) == 5


def test_secret_sources_and_precedence(tmp_path) -> None:
    path = tmp_path / "s"
    path.write_bytes(b"  " + b"f" * 40 + b"\n")
    env = {ENV_SECRET: "e" * 20}
    assert configured_secret(path, env).key == b"f" * 40  # the flag's file wins
    assert configured_secret(None, env | {ENV_SECRET_FILE: str(path)}).key == b"f" * 40
    from_env = configured_secret(None, env)
    assert from_env.key == b"e" * 20 and from_env.source == f"${ENV_SECRET}" and from_env.shared
    assert configured_secret(None, {}) is None
    short = tmp_path / "short"
    short.write_text("hunter2\n")
    with pytest.raises(InvalidArgument, match=r"^canary_secret: file .*short must hold at least 16 bytes") as info:
        configured_secret(short, {})
    assert "hunter2" not in str(info.value)
    with pytest.raises(InvalidArgument, match=r"^canary_secret_file: cannot read .*missing"):
        configured_secret(tmp_path / "missing", {})
    with pytest.raises(InvalidArgument, match=rf"^canary_secret: \${ENV_SECRET} must hold"):
        configured_secret(None, {ENV_SECRET: "short"})


def test_random_secret_warns_once_and_the_secret_is_never_shown(server, tmp_path, monkeypatch, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setattr(secret_module, "_random", None)  # as in a fresh process
    first, second = random_secret(), random_secret()
    assert first is second and not first.shared and len(first.key) == 32
    warnings = [r.getMessage() for r in caplog.records if r.name == "tandem.canary.secret"]
    assert len(warnings) == 1 and "replicas place a session on different arms" in warnings[0], warnings

    text = uuid.uuid4().hex * 2
    path = tmp_path / "canary.secret"
    path.write_text(text)
    monkeypatch.delenv(ENV_SECRET, raising=False)
    monkeypatch.delenv(ENV_SECRET_FILE, raising=False)
    parser = argparse.ArgumentParser()
    add_serve_canary_options(parser)
    arms = '[{"name": "stable", "weight": 50}, {"name": "canary", "draftModel": "d", "weight": 50}]'
    options = serve_canary_options(parser.parse_args(
        ["--canary-arms", arms, "--canary-deployment", "flag-" + uuid.uuid4().hex[:8], "--canary-secret-file",
         str(path), "--canary-greedy-check-rate", "0"]))
    assert options.secret.key == text.encode() and options.secret.source == f"file {path}"
    caplog.clear()
    gateway = start_controller(options, server.url)
    try:
        assert arms_of(gateway, IDS) == arms_of(replica(server.url, options.deployment, options.secret), IDS)
    finally:
        gateway.close()
    shown = [repr(options), repr(options.secret), str(options.secret), *(r.getMessage() for r in caplog.records)]
    assert not any(text in item or text.encode().hex() in item for item in shown), shown
    assert not any(r.name == "tandem.canary.secret" for r in caplog.records)  # a shared secret: no warning
    # the environment alone (a Kubernetes secretKeyRef) configures it too
    from_env = options_from_env({"TANDEM_CANARY_ARMS": arms, ENV_SECRET: text})
    assert from_env.secret.key == text.encode()
    assert options_from_env({"TANDEM_CANARY_ARMS": arms}).secret is None  # the controller's random one
