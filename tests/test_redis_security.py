"""Redis with a password and TLS: the embedded server's lockdown, `--redis-url` credentials from flags, env and files,
rediss:// with a private CA, and passwords kept out of every message. Real redis-server processes throughout."""

from __future__ import annotations

import argparse
import contextlib
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, urlsplit

import pytest
import redis

from pki import make_pki
from tandem.cli.redis_options import add_redis_options, session_store_url
from tandem.errors import InvalidArgument
from tandem.sessions import (
    EmbeddedRedis,
    RedisSessionStore,
    RedisSetupError,
    find_redis_server,
    open_session_store,
    redact_url,
    with_credentials,
)
from tandem.sessions.embedded import free_port

PASSWORD = "s3cret-Pa55word_for-tests"


@pytest.fixture(scope="module")
def server():
    with EmbeddedRedis() as embedded:
        yield embedded


@pytest.fixture(scope="module")
def protected():
    """A password-protected server, as an operator's Redis would be (the embedded one, given our password)."""
    with EmbeddedRedis(password=PASSWORD) as embedded:
        yield embedded


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_redis_options(parser)
    return parser.parse_args(list(argv))


def test_embedded_redis_refuses_a_client_without_its_password(server) -> None:
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        sock.sendall(b"PING\r\n")
        assert sock.recv(64).startswith(b"-NOAUTH")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=server.host, port=server.port, socket_timeout=5).get("x")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=server.host, port=server.port, password="not-it", socket_timeout=5).get("x")
    client = redis.Redis.from_url(server.url, socket_timeout=5)  # tandem's own clients: the URL carries it
    assert client.ping()
    config = client.config_get("bind", "protected-mode", "requirepass")
    assert config["bind"] == "127.0.0.1" and config["protected-mode"] == "yes"
    assert config["requirepass"] == server.password and len(server.password) >= 32


class ConfigSeen(EmbeddedRedis):
    """The embedded server, noting its config file as written (it is removed once the server is up)."""

    def _write_config(self, log_path: Path) -> Path:
        path = super()._write_config(log_path)
        self.seen = (stat.S_IMODE(path.stat().st_mode), path.read_text())
        return path


def test_embedded_password_is_in_a_private_file_not_on_the_command_line(server) -> None:
    with ConfigSeen() as own:
        mode, text = own.seen
        assert mode == 0o600 and f'requirepass "{own.password}"' in text and "protected-mode yes" in text
    cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
    assert server.password.encode() not in cmdline
    assert not (Path(server._dir) / "redis.conf").exists()  # read at start, then removed
    assert stat.S_IMODE(Path(server._dir).stat().st_mode) == 0o700
    assert server.password not in server.redacted_url and ":***@" in server.redacted_url
    assert EmbeddedRedis().password != EmbeddedRedis().password  # random per server


def test_embedded_keeps_its_password_across_a_restart() -> None:
    with EmbeddedRedis() as own:
        store = RedisSessionStore(own.url)
        own.stop()
        own.start()  # same port, same password: clients holding the URL reconnect
        store.put("s", {"k": 1})
        assert store.healthy and store.get("s") == {"k": 1}


def test_a_protected_server_takes_the_right_password_from_url_env_or_file(protected, tmp_path, monkeypatch) -> None:
    bare = f"redis://127.0.0.1:{protected.port}/0"
    monkeypatch.delenv("TANDEM_REDIS_PASSWORD", raising=False)
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")  # `echo` leaves a newline; Kubernetes Secret files have none
    urls = [session_store_url(parse("--redis-url", f"redis://:{PASSWORD}@127.0.0.1:{protected.port}/0")),
            session_store_url(parse("--redis-url", bare, "--redis-password-file", str(password_file)))]
    monkeypatch.setenv("TANDEM_REDIS_PASSWORD", PASSWORD)
    urls.append(session_store_url(parse("--redis-url", bare)))
    for n, url in enumerate(urls):
        store = open_session_store(url)
        store.put(f"s{n}", {"k": n})
        assert store.healthy and store.get(f"s{n}") == {"k": n}
        assert PASSWORD not in str(store.stats())
        store.close()


def test_a_missing_or_wrong_password_fails_clearly_without_leaking_it(protected, tmp_path) -> None:
    bare = f"redis://127.0.0.1:{protected.port}/0"
    with pytest.raises(RedisSetupError, match="requires a password and none was given") as missing:
        open_session_store(bare)
    assert "TANDEM_REDIS_PASSWORD" in str(missing.value)
    wrong = "Wrong-" + PASSWORD
    with pytest.raises(RedisSetupError, match="refused tandem's credentials") as refused:
        open_session_store(with_credentials(bare, wrong))
    assert wrong not in str(refused.value) and "redis://:***@127.0.0.1" in str(refused.value)
    with pytest.raises(RedisSetupError, match="refused"):
        open_session_store(f"redis://someone:{PASSWORD}@127.0.0.1:{protected.port}/0")  # no such ACL user
    # An unreachable Redis is still an outage to ride out, not a setup error.
    down = open_session_store(f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0")
    assert not down.healthy and PASSWORD not in str(down.stats())
    down.close()


def test_the_password_is_given_once_and_files_are_checked_before_anything_starts(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_REDIS_PASSWORD", PASSWORD)
    with pytest.raises(InvalidArgument, match="already has a password") as twice:
        session_store_url(parse("--redis-url", "redis://:other@h:6379/0"))
    assert "other" not in str(twice.value) and PASSWORD not in str(twice.value)
    monkeypatch.delenv("TANDEM_REDIS_PASSWORD")
    with pytest.raises(InvalidArgument, match="redis_password_file: cannot read"):
        session_store_url(parse("--redis-url", "redis://h:6379/0", "--redis-password-file", str(tmp_path / "none")))
    (tmp_path / "empty").write_text("")
    with pytest.raises(InvalidArgument, match="is empty"):
        session_store_url(parse("--redis-url", "redis://h:6379/0", "--redis-password-file", str(tmp_path / "empty")))
    with pytest.raises(InvalidArgument, match="redis_ca: a CA only applies to TLS"):
        session_store_url(parse("--redis-url", "redis://h:6379/0", "--redis-ca", str(tmp_path / "empty")))
    with pytest.raises(InvalidArgument, match="redis_ca: cannot read"):
        session_store_url(parse("--redis-url", "rediss://h:6379/0", "--redis-ca", str(tmp_path / "none")))
    assert session_store_url(parse()) is None and session_store_url(parse("--redis-url", "memory")) == "memory"
    (tmp_path / "password").write_text(PASSWORD)
    for url in ((), ("--redis-url", "memory")):  # credentials for no Redis: a URL left out, not to run on without it
        with pytest.raises(InvalidArgument, match="redis_password_file: given for no --redis-url"):
            session_store_url(parse(*url, "--redis-password-file", str(tmp_path / "password")))
        with pytest.raises(InvalidArgument, match="redis_ca: given for no --redis-url"):
            session_store_url(parse(*url, "--redis-ca", str(tmp_path / "password")))


def test_with_credentials_and_redact_url_forms(tmp_path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-")
    assert with_credentials("redis://h:1/0", "p@ss:w/rd") == "redis://:p%40ss%3Aw%2Frd@h:1/0"
    assert redis.connection.parse_url(with_credentials("redis://h:1/0", "p@ss:w/rd"))["password"] == "p@ss:w/rd"
    assert with_credentials("redis://app@h:1/0", "pw") == "redis://app:pw@h:1/0"
    assert with_credentials("unix:///run/redis.sock?db=2", "pw") == "unix:///run/redis.sock?db=2&password=pw"
    assert (with_credentials("rediss://h:1/0?ssl_cert_reqs=required", None, str(ca))
            == f"rediss://h:1/0?ssl_cert_reqs=required&ssl_ca_certs={quote(str(ca), safe='')}")
    assert redact_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("rediss://app:pw@[::1]:6380/0") == "rediss://app:***@[::1]:6380/0"
    assert redact_url("redis://app@h:1/0") == "redis://app@h:1/0"
    assert redact_url("unix:///s.sock?db=2&password=pw") == "unix:///s.sock?db=2&password=%2A%2A%2A"
    assert "pw" not in redact_url("redis://:pw@h:notaport/0")
    with pytest.raises(InvalidArgument, match="expected redis://") as bad:
        with_credentials("http://:pw@h:1/0", None)
    assert "pw" not in str(bad.value)


def test_serve_announces_the_embedded_redis_without_its_password(capsys) -> None:
    from tandem.cli.serving import session_store

    with contextlib.ExitStack() as stack:
        store = session_store(None, stack)
        assert isinstance(store, RedisSessionStore) and store.healthy
        out = capsys.readouterr().out
        password = urlsplit(store.url).password
        assert "embedded Redis at redis://:***@127.0.0.1:" in out and password and password not in out


@contextlib.contextmanager
def tls_redis(pki: dict, workdir: Path) -> Iterator[int]:
    """redis-server with TLS only (no plaintext port) and a password; yields its TLS port."""
    port = free_port()
    config = workdir / "redis.conf"
    config.write_text("\n".join([
        "port 0", f"tls-port {port}", "bind 127.0.0.1", f'requirepass "{PASSWORD}"', 'save ""', "appendonly no",
        f'dir "{workdir}"', f'tls-cert-file "{pki["server_cert_path"]}"', f'tls-key-file "{pki["server_key_path"]}"',
        f'tls-ca-cert-file "{pki["ca_path"]}"', "tls-auth-clients no", f'logfile "{workdir / "redis.log"}"']) + "\n")
    process = subprocess.Popen([find_redis_server(), str(config)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            log = workdir / "redis.log"
            if process.poll() is not None and log.exists() and "Failed to configure TLS" in log.read_text():
                pytest.skip("this redis-server has no TLS support")
            assert process.poll() is None and time.monotonic() < deadline, (workdir / "redis.log").read_text()
            time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_rediss_with_a_private_ca_end_to_end(tmp_path, monkeypatch) -> None:
    pki = make_pki(tmp_path)
    other_ca = tmp_path / "other-ca.pem"
    other_ca.write_bytes(pki["other_ca"])
    monkeypatch.setenv("TANDEM_REDIS_PASSWORD", PASSWORD)
    with tls_redis(pki, tmp_path) as port:
        url = session_store_url(parse("--redis-url", f"rediss://127.0.0.1:{port}/0", "--redis-ca", pki["ca_path"]))
        store = open_session_store(url)
        store.put("tls", {"k": 1})
        assert store.healthy and store.get("tls") == {"k": 1}
        store.close()
        monkeypatch.setenv("TANDEM_REDIS_CA", pki["ca_path"])  # the CA from the environment, as a Secret mount
        assert open_session_store(session_store_url(parse("--redis-url", f"rediss://127.0.0.1:{port}/0"))).healthy
        monkeypatch.delenv("TANDEM_REDIS_CA")

        # A server certificate the client cannot verify: the system CAs, or the wrong private CA.
        for ca in ([], ["--redis-ca", str(other_ca)]):
            with pytest.raises(RedisSetupError, match="TLS handshake failed") as failed:
                open_session_store(session_store_url(parse("--redis-url", f"rediss://127.0.0.1:{port}/0", *ca)))
            assert PASSWORD not in str(failed.value) and "--redis-ca" in str(failed.value)
        # TLS right, password wrong.
        monkeypatch.setenv("TANDEM_REDIS_PASSWORD", "not-" + PASSWORD)
        with pytest.raises(RedisSetupError, match="refused tandem's credentials"):
            open_session_store(session_store_url(parse("--redis-url", f"rediss://127.0.0.1:{port}/0",
                                                       "--redis-ca", pki["ca_path"])))
