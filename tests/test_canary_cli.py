"""`tandem canary status|set|promote|rollback` against a real redis-server, as an operator would drive it while
gateways (here: a CanaryController) serve from the same state."""

from __future__ import annotations

import json
import uuid

import pytest

from tandem.canary import CanaryController, Outcome, RedisCanaryStore
from tandem.cli.main import main
from tandem.sessions import EmbeddedRedis

ARMS = '[{"name": "stable", "draftModel": "d0", "weight": 90}, {"name": "canary", "draftModel": "d1", "weight": 10}]'


@pytest.fixture(scope="module")
def server():
    with EmbeddedRedis() as embedded:
        yield embedded


@pytest.fixture
def canary(server, monkeypatch):
    """Runs `tandem canary ...` on a fresh deployment; returns (exit code, stdout, stderr)."""
    monkeypatch.setenv("REDIS_URL", server.url)
    deployment = "cli-" + uuid.uuid4().hex[:8]

    def run(capsys, *args: str) -> tuple[int, str, str]:
        code = main(["canary", *args, "--deployment", deployment])
        out, err = capsys.readouterr()
        return code, out, err

    run.deployment = deployment
    return run


def test_round_trip(canary, capsys, server) -> None:
    code, out, err = canary(capsys, "set", "--arms", ARMS, "--steps", "10", "50", "100",
                            "--threshold", "min_sessions=100")
    assert code == 0 and "register stable,canary" in out and "configure" in out, err
    gateway = CanaryController(RedisCanaryStore(server.url), canary.deployment)  # a gateway with no arms configured
    assert gateway.state().weights == {"stable": 90.0, "canary": 10.0}
    assert gateway.state().thresholds.min_sessions == 100
    for i in range(40):
        assignment = gateway.arm_for(f"s{i}")
        gateway.record(assignment, Outcome(assignment.session, drafted=8, accepted=6, tpot_s=0.01))
    gateway.maybe_decide()  # stores observations and its analysis

    code, out, _ = canary(capsys, "status")
    assert code == 0, out
    assert f"deployment {canary.deployment}  status running  auto on  generation 1" in out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("stable ", "canary "))}
    assert lines["stable"][1] == "90" and lines["stable"][3] == "d0" and lines["stable"][6] == "0.75"
    assert int(lines["stable"][4]) + int(lines["canary"][4]) == 40
    assert lines["stable"][11] == "1" and "each tenant capped at 0.25 of an arm's weight" in out  # anonymous: one
    assert "  canary: hold (min_sessions): waiting for sessions" in out and "register" in out

    assert canary(capsys, "set", "stable=75", "canary=25", "--reason", "more traffic")[0] == 0
    status = json.loads(canary(capsys, "status", "--json")[1])
    assert status["state"]["arms"][1] == {"name": "canary", "weight": 25.0, "target": "", "draft": "d1"}
    assert status["state"]["log"][-1]["reasons"] == ["more traffic"] and status["state"]["generation"] == 2
    assert status["summaries"]["canary"]["requests"] == 0  # a new generation: fresh windows
    assert status["evaluation"]["generation"] == 1 and status["evaluation"]["verdicts"]["canary"]["action"] == "hold"
    earlier = json.loads(canary(capsys, "status", "--json", "--generation", "1")[1])
    assert sum(earlier["summaries"][arm]["requests"] for arm in ("stable", "canary")) == 40

    code, out, _ = canary(capsys, "promote")
    assert code == 0 and "promote canary (manual): stable=75 canary=25 -> stable=50 canary=50" in out
    code, out, _ = canary(capsys, "rollback", "canary", "--reason", "pager")
    assert code == 0 and "stable=100 canary=0" in out and "pager" in out
    assert gateway.state(refresh=True).status == "rolled_back"
    assert {gateway.arm_for(f"s{i}").arm.name for i in range(100)} == {"stable"}
    code, out, _ = canary(capsys, "promote", "canary", "--to", "100")
    assert code == 0 and json.loads(canary(capsys, "status", "--json")[1])["state"]["status"] == "promoted"
    assert canary(capsys, "set", "--manual")[0] == 0
    assert RedisCanaryStore(server.url).load(canary.deployment).auto is False


@pytest.mark.parametrize(("args", "message"), [
    (["status"], "error: --deployment: no canary registered"),
    (["set", "stable=100"], "error: --deployment: no canary registered"),
    (["set", "--arms", "[{"], "error: --arms: not valid JSON"),
    (["set", "--arms", '[{"name": "a", "weight": 50}]'], "error: weights: must sum to 100, got 50"),
    (["set"], "error: weights: give ARM=PERCENT"),
    (["set", "stable"], "error: weights: expected ARM=PERCENT, got 'stable'"),
    (["set", "--steps", "5", "x"], "error: --steps: expected percentages, got '5 x'"),
    (["set", "--arms", ARMS, "--baseline", "nope"], "error: --baseline: 'nope' is not an arm"),
    (["set", "--arms", ARMS, "--threshold", "min_sessions=-2"], "error: min_sessions:"),
])
def test_bad_input_exits_2_naming_the_field(canary, capsys, args: list[str], message: str) -> None:
    code, _, err = canary(capsys, *args)
    assert code == 2 and message in err, err


def test_bad_changes_to_a_registered_canary(canary, capsys) -> None:
    assert canary(capsys, "set", "--arms", ARMS)[0] == 0
    for args, message in ((["set", "stable=80", "nope=20"], "error: weights: unknown arm(s) ['nope']"),
                          (["set", "stable=80", "canary=10"], "error: weights: must sum to 100, got 90"),
                          (["promote", "stable"], "error: arm: 'stable' is the baseline"),
                          (["rollback", "ghost"], "error: arm: no arm 'ghost'"),
                          (["promote", "--to", "5"], "error: --to:"),
                          (["status", "--generation", "7"], "error: --generation: must be between 1 and 1")):
        code, _, err = canary(capsys, *args)
        assert code == 2 and message in err, (args, err)


def test_missing_redis_url_and_unreachable_redis(monkeypatch, capsys) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert main(["canary", "status"]) == 2
    assert "error: --redis-url: give the Redis the gateways use (or set REDIS_URL)" in capsys.readouterr().err
    assert main(["canary", "status", "--redis-url", "http://x"]) == 2
    assert "error: --redis-url: expected redis://" in capsys.readouterr().err
    assert main(["canary", "rollback", "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: redis: redis://127.0.0.1:1/0") and "Traceback" not in err, err


def test_corrupt_state_is_reported_and_replaced_by_set_arms(canary, capsys, server) -> None:
    import redis

    assert canary(capsys, "set", "--arms", ARMS)[0] == 0
    gateway = CanaryController(RedisCanaryStore(server.url), canary.deployment, cache_ttl_s=0.0)
    assert gateway.arm_for("s").arm.name in ("stable", "canary")
    redis.Redis.from_url(server.url).set(f"tandem:canary:{canary.deployment}", '{"arms": 3}')
    assert gateway.arm_for("s") is not None and not gateway.metrics()["store_healthy"]  # keeps the last known state
    code, _, err = canary(capsys, "status")
    assert code == 2 and "stored canary state is invalid" in err and "tandem canary set --arms" in err
    assert canary(capsys, "set", "stable=100")[0] == 2
    assert canary(capsys, "set", "--arms", ARMS)[0] == 0
    assert json.loads(canary(capsys, "status", "--json")[1])["state"]["arms"][0]["weight"] == 90


def test_password_from_the_environment_or_a_file(server, monkeypatch, capsys, tmp_path) -> None:
    """The CLI reaches a password-protected Redis the way the gateways do: $TANDEM_REDIS_PASSWORD or a file."""
    bare = f"redis://{server.host}:{server.port}/0"
    monkeypatch.delenv("TANDEM_REDIS_PASSWORD", raising=False)
    assert main(["canary", "status", "--redis-url", bare, "--deployment", "pw"]) == 2
    err = capsys.readouterr().err
    assert "authenticated" in err and "no canary registered" not in err and server.password not in err
    monkeypatch.setenv("TANDEM_REDIS_PASSWORD", server.password)
    assert main(["canary", "status", "--redis-url", bare, "--deployment", "pw"]) == 2  # reached: no canary yet
    assert "no canary registered" in capsys.readouterr().err
    monkeypatch.delenv("TANDEM_REDIS_PASSWORD")
    secret = tmp_path / "password"
    secret.write_text(server.password + "\n")
    assert main(["canary", "status", "--redis-url", bare, "--redis-password-file", str(secret),
                 "--deployment", "pw"]) == 2
    assert "no canary registered" in capsys.readouterr().err


def test_set_help_shows_no_default_for_the_decision_mode(capsys) -> None:
    """Neither --auto nor --manual: the decisions stay as they are, so help shows no default (it said True)."""
    with pytest.raises(SystemExit):
        main(["canary", "set", "--help"])
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if "automatic decisions" in line and "default" in line] == []
