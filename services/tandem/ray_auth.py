"""Ray token authentication for the Ray clusters tandem starts and joins (Ray >= 2.52.0, pyproject's pin).

Whoever reaches a Ray cluster's GCS or raylet ports can run any code on it (tasks, actors, the job API), and a port
on 127.0.0.1 is reachable by every local user. With `RAY_AUTH_MODE=token` every Ray RPC and HTTP endpoint wants a
shared bearer token; Ray reads it from $RAY_AUTH_TOKEN, else the file at $RAY_AUTH_TOKEN_PATH, else
~/.ray/auth_token. These are environment variables because every process of the cluster needs them: tandem sets
them in its own process before `ray.init`, and the GCS, raylet and workers Ray spawns inherit them.

- A local cluster (`tandem serve` without --ray-address) always gets token auth: the token of --ray-token-file or
  of Ray's own variables, else a fresh random one in a 0600 file of a private temp dir (not ~/.ray/auth_token,
  which other clusters of the user may read or overwrite). `RAY_AUTH_MODE=disabled`, set on purpose, is obeyed
  with a warning.
- Joining a cluster (`--ray-address`, `tandem pools`, `tandem gateway`): --ray-token-file, or $RAY_AUTH_TOKEN /
  $RAY_AUTH_TOKEN_PATH (Kubernetes passes them from a Secret), or else Ray's own ~/.ray/auth_token turn token mode
  on for this client. The last is what `ray start --head` does with that file (it turns token auth on when a token
  exists there), and what `ray.init` does for a cluster it finds itself, but not for an address it is given.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

from tandem.errors import InvalidArgument, TandemError

log = logging.getLogger(__name__)
# The runtime env of the Ray drivers tandem starts: tokenizers' own thread pool off in every worker process
RUNTIME_ENV = {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}

MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"


def _token_configured() -> bool:
    return bool(os.environ.get(TOKEN_ENV) or os.environ.get(TOKEN_PATH_ENV))


def default_token_file() -> Path:
    """Where Ray keeps a user's token when no variable names one (`ray get-auth-token --generate` writes it)."""
    return Path.home() / ".ray" / "auth_token"


def _use_token_file(path: str) -> None:
    """Point Ray at `path`, checked now: Ray aborts a process (not raises) when the file is unreadable or empty."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise InvalidArgument(f"ray_token_file: cannot read {path} ({exc.strerror or exc})") from None
    if not token:
        raise InvalidArgument(f"ray_token_file: {path} is empty")
    os.environ[TOKEN_PATH_ENV] = os.path.abspath(path)
    os.environ.pop(TOKEN_ENV, None)  # Ray prefers $RAY_AUTH_TOKEN over the file: the flag must win


def _new_token_file() -> None:
    """A random token (256 bits, as Ray's own generator) in a file only this user can read, removed at exit."""
    directory = tempfile.mkdtemp(prefix="tandem-ray-auth-")  # 0700
    path = os.path.join(directory, "auth_token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_hex(32))
    # Registered before ray.init, so it runs after the ray.shutdown Ray registers (atexit runs last-in first-out):
    # Ray's processes may read the file until they are gone.
    atexit.register(shutil.rmtree, directory, True)
    os.environ[TOKEN_PATH_ENV] = path
    os.environ.pop(TOKEN_ENV, None)


def _refresh_ray_config() -> None:
    """This process's Ray caches the auth mode and token at import; re-read them (what Ray itself does when it turns
    token mode on). Private API: a Ray without it reads the environment at ray.init anyway."""
    with contextlib.suppress(ImportError, AttributeError):
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


def configure_local_cluster(token_file: str | None = None) -> str:
    """Before `ray.init()` starts a local cluster: token auth on (see the module's doc). Returns the mode."""
    if token_file:
        _use_token_file(token_file)
    elif os.environ.get(MODE_ENV, "").lower() == "disabled":
        log.warning("%s=disabled: the local Ray cluster starts without token authentication; any local user who "
                    "reaches its ports can run code in it", MODE_ENV)
        return "disabled"
    elif not _token_configured():
        _new_token_file()
    os.environ[MODE_ENV] = "token"
    _refresh_ray_config()
    return "token"


def configure_client(token_file: str | None = None) -> str:
    """Before `ray.init(address=...)` joins a cluster: token mode when a token is given. Returns the mode."""
    if token_file:
        _use_token_file(token_file)
        os.environ[MODE_ENV] = "token"
    elif MODE_ENV not in os.environ and (_token_configured() or default_token_file().is_file()):
        os.environ[MODE_ENV] = "token"  # Ray does not infer token mode from a token alone for a given address
    _refresh_ray_config()
    return os.environ.get(MODE_ENV, "disabled").lower()


def refused_token(error: BaseException) -> bool:
    """Whether a failed ray.init was the cluster refusing this client's token (missing or wrong): Ray wraps that in
    a generic ConnectionError, naming token authentication only in the errors it chains."""
    seen: BaseException | None = error
    for _ in range(8):  # a short chain; bounded anyway
        if seen is None:
            return False
        text = f"{type(seen).__name__} {seen}"
        if "AuthenticationError" in text or "token-auth" in text or "Unauthenticated" in text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


CLIENT_SCHEME = "ray://"
CLIENT_PING_TIMEOUT_S = 10.0
# Ray Client's proxy forks a server process for each client; now and then that process dies at birth (gRPC's
# event engine after fork: "epoll_wait error: Bad file descriptor" in its log, seen once in CI), and the client is
# told "Initialization failure from server". The next connection gets a new process: so many tries in all, a
# growing pause between them (CI once saw two such deaths in a row, on a loaded machine).
CLIENT_STARTS = 5
CLIENT_RETRY_PAUSE_S = 0.5
SERVER_START_FAILED = "Initialization failure from server"


def ray_client_refuses_token(address: str, timeout_s: float = CLIENT_PING_TIMEOUT_S) -> bool:
    """Whether the Ray Client server at a ray:// `address` refuses this client's token (after configure_client).

    Ray Client (Ray 2.60) takes the server's UNAUTHENTICATED answer for a server not up yet: it tries again three
    times, about 50 s, then raises a bare "ray client connection timeout" that chains nothing refused_token could
    read. One PING on a channel made by Ray's own helper (it adds the token as Ray Client's channel does) tells at
    once; the proxy answers a PING itself, starting nothing for it. False where it cannot tell (another Ray, no
    answer): ray.init then reports what it finds."""
    try:
        import grpc
        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import ray_client_pb2, ray_client_pb2_grpc
    except ImportError:
        return False
    try:
        channel = init_grpc_channel(address.removeprefix(CLIENT_SCHEME), asynchronous=False)
    except Exception:  # an address Ray itself would refuse: ray.init says how
        return False
    ping = ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING)
    try:
        ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo(ping, timeout=timeout_s)
    except grpc.RpcError as exc:
        return exc.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        channel.close()
    return False


def join_cluster(address: str, token_file: str | None = None, **init: object) -> None:
    """ray.init on the running cluster at `address` (a GCS address, or a Ray Client URL ray://HOST:PORT) with this
    client's token (configure_client); `init`: ray.init's other arguments. A refusal, or any failure to join, is a
    TandemError that says what to do."""
    import ray

    mode = configure_client(token_file)

    def refused() -> TandemError:
        fix = ("the token is not the cluster's" if mode == "token" else
               "it wants a token: pass --ray-token-file FILE or set RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH")
        return TandemError(f"the Ray cluster at {address} refused this client ({fix})")

    client = address.startswith(CLIENT_SCHEME)
    if client and ray_client_refuses_token(address):
        raise refused()
    for start in range(1, CLIENT_STARTS + 1 if client else 2):
        try:
            ray.init(address=address, runtime_env=RUNTIME_ENV, log_to_driver=False, **init)
            return
        except (ConnectionError, RuntimeError, ray.exceptions.RayError) as exc:
            if refused_token(exc):
                raise refused() from exc
            if not (client and SERVER_START_FAILED in str(exc) and start < CLIENT_STARTS):
                raise TandemError(f"could not join the Ray cluster at {address}: {exc}") from exc
            log.warning("the Ray Client server at %s failed to start this client's session (try %d of %d): %s",
                        address, start, CLIENT_STARTS, str(exc).splitlines()[0])
            ray.shutdown()
            time.sleep(CLIENT_RETRY_PAUSE_S * start)
