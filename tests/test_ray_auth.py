"""Ray token authentication: the local cluster `tandem serve` starts wants its token, and `tandem pools` joins a token
cluster with --ray-token-file. Real Ray, each cluster in processes of its own (Ray reads the token settings from the
environment when a process starts Ray, so the test process's own Ray must not see them)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("ray")

from pools_harness import BIN, RAY_TOKEN_FILE, head_env, ray_head

REFUSED_S = 120  # Ray retries an unauthenticated GCS connection for ~20 s before it gives up


def _python(script: str, env: dict, timeout: float = REFUSED_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)


def _without_ray_settings(**extra: str) -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | extra


def test_token_settings_for_local_and_joined_clusters(tmp_path) -> None:
    """What configure_local_cluster / configure_client leave in the environment for Ray; in a process of its own
    (they refresh its Ray's cached config), one case after another from the same starting environment."""
    token = tmp_path / "token"
    token.write_text("t" * 64 + "\n")
    (tmp_path / "empty").write_text("")
    cases = [("configure_local_cluster", None, {}), ("configure_local_cluster", str(token), {}),
             ("configure_local_cluster", None, {"RAY_AUTH_TOKEN": "x" * 64}),
             ("configure_local_cluster", None, {"RAY_AUTH_MODE": "disabled"}),
             ("configure_client", str(token), {"RAY_AUTH_TOKEN": "env"}),
             ("configure_client", None, {"RAY_AUTH_TOKEN_PATH": str(token)}), ("configure_client", None, {}),
             ("configure_client", str(tmp_path / "empty"), {}), ("configure_client", str(tmp_path / "none"), {}),
             ("configure_client", None, {"HOME": str(tmp_path / "home")})]
    (tmp_path / "home" / ".ray").mkdir(parents=True)
    (tmp_path / "home" / ".ray" / "auth_token").write_text("h" * 64)  # Ray's own default token file
    script = """if True:
        import json, os, stat, sys
        from tandem import ray_auth
        from tandem.errors import InvalidArgument
        base, out = dict(os.environ), []
        for what, arg, env in json.loads(sys.argv[1]):
            os.environ.clear()
            os.environ.update(base | env)
            try:
                mode = getattr(ray_auth, what)(arg)
            except InvalidArgument as exc:
                mode = f"error: {exc}"
            path = os.environ.get("RAY_AUTH_TOKEN_PATH")
            private = bool(path) and stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(open(path).read()) == 64
            out.append([mode, os.environ.get("RAY_AUTH_MODE"), path, private, os.environ.get("RAY_AUTH_TOKEN")])
        print(json.dumps(out))
    """
    done = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], capture_output=True, text=True,
                          env=_without_ray_settings(HOME=str(tmp_path)), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    fresh, given, from_env, disabled, flag, path_env, none, empty, missing, default = json.loads(
        done.stdout.splitlines()[-1])
    # A local cluster without settings: token mode, a fresh random token in a private file (not ~/.ray/auth_token).
    assert fresh[:2] == ["token", "token"] and fresh[3] and "tandem-ray-auth-" in fresh[2]
    assert not (tmp_path / ".ray" / "auth_token").exists()
    assert given[:3] == ["token", "token", str(token)]
    assert from_env == ["token", "token", None, False, "x" * 64]
    assert disabled[:3] == ["disabled", "disabled", None]  # set on purpose: obeyed (with a warning)
    # Joining: token mode once a token is given (the flag wins over Ray's variables); else Ray's settings stand.
    assert flag == ["token", "token", str(token), False, None]
    assert path_env[:3] == ["token", "token", str(token)]
    assert none[:3] == ["disabled", None, None]
    assert default[:3] == ["token", "token", None]  # ~/.ray/auth_token, which Ray reads itself once in token mode
    assert empty[0] == f"error: ray_token_file: {tmp_path}/empty is empty"
    assert missing[0].startswith("error: ray_token_file: cannot read")


HEAD = """if True:
    import json, os, sys
    import ray
    from tandem.engines import ClusterOptions
    from tandem.engines.cluster import start_ray

    start_ray(ClusterOptions(draft_workers=0, target_replicas=1))

    @ray.remote(num_cpus=0)
    def mode():
        return os.environ.get("RAY_AUTH_MODE")

    print(json.dumps({"address": ray.get_runtime_context().gcs_address, "token": os.environ["RAY_AUTH_TOKEN_PATH"],
                      "worker_mode": ray.get(mode.remote(), timeout=120)}), flush=True)
    sys.stdin.read()  # until the test closes stdin
"""

JOIN = "import ray; ray.init(address={address!r}, log_to_driver=False); print(ray.get(ray.put(7)))"


def test_the_local_cluster_tandem_starts_refuses_clients_without_its_token(tmp_path) -> None:
    head = subprocess.Popen([sys.executable, "-c", HEAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=_without_ray_settings(HOME=str(tmp_path)))
    try:
        line = [None]
        reader = threading.Thread(target=lambda: line.__setitem__(0, head.stdout.readline()), daemon=True)
        reader.start()
        reader.join(180)
        assert line[0], "the local Ray cluster did not start"
        info = json.loads(line[0])
        token = Path(info["token"])
        assert info["worker_mode"] == "token"  # its workers run (and were started) with token auth
        assert stat.S_IMODE(token.stat().st_mode) == 0o600 and stat.S_IMODE(token.parent.stat().st_mode) == 0o700
        join = JOIN.format(address=info["address"])
        clients = {"with the token": _without_ray_settings(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token)),
                   "no token": _without_ray_settings(HOME=str(tmp_path)),
                   "another token": _without_ray_settings(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64)}
        results: dict = {}
        threads = [threading.Thread(target=lambda n=name, e=env: results.__setitem__(n, _python(join, e)))
                   for name, env in clients.items()]  # at once: a refusal takes Ray ~20 s of retries
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(REFUSED_S + 10)
        assert results["with the token"].returncode == 0 and results["with the token"].stdout.strip() == "7"
        for name in ("no token", "another token"):
            assert results[name].returncode != 0, name
            assert "Authentication token is missing or incorrect" in results[name].stderr, results[name].stderr[-2000:]
    finally:
        head.stdin.close()
        head.wait(120)
    assert not token.parent.exists()  # the generated token goes with the cluster


def test_pools_commands_join_a_token_cluster_with_ray_token_file(tmp_path, tmp_path_factory) -> None:
    # (a short temp dir: Ray's AF_UNIX socket paths under it must stay within 107 bytes)
    with ray_head(tmp_path_factory.mktemp("ray"), cpus=1) as address:
        # The head's token from the flag alone (no RAY_AUTH_* in the environment).
        done = subprocess.run([str(BIN / "tandem"), "pools", "status", "--json", "--ray-token-file", RAY_TOKEN_FILE],
                              env=head_env(address, token=False), capture_output=True, text=True, timeout=REFUSED_S)
        assert done.returncode == 0 and json.loads(done.stdout) == {"pools": []}, done.stderr[-2000:]
        done = subprocess.run([str(BIN / "tandem"), "pools", "status"], env=head_env(address, token=False) | {
            "HOME": str(tmp_path)}, capture_output=True, text=True, timeout=REFUSED_S)
        assert done.returncode == 2 and "refused this client (it wants a token: pass --ray-token-file" in done.stderr
        # The head's token in Ray's default file, as `ray start --head` finds it (docs/operations.md's quickstart).
        home = tmp_path / "home"
        (home / ".ray").mkdir(parents=True)
        (home / ".ray" / "auth_token").write_text(Path(RAY_TOKEN_FILE).read_text())
        done = subprocess.run([str(BIN / "tandem"), "pools", "status", "--json"],
                              env=head_env(address, token=False) | {"HOME": str(home)}, capture_output=True, text=True,
                              timeout=REFUSED_S)
        assert done.returncode == 0 and json.loads(done.stdout) == {"pools": []}, done.stderr[-2000:]
