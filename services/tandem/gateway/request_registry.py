"""Which gateway runs a request: request ids unique across gateway replicas, and Abort answered by any of them.

Gateways that share a Redis (the sessions') register each running request under `tandem:request:<scoped id>`, its
value the gateway's id and a claim number, with one atomic script that refuses an id another live gateway holds (as
one gateway refuses an id it runs); they renew those keys while the requests run and delete them as the requests end
(before the last event reaches the client: an id sent again at once finds itself free, on any replica).
Every gateway listens on its own channel, `tandem:abort:<gateway id>`: an Abort that finds nothing on the gateway it
reached reads the key and publishes the id there, and the owner stops it as its own Abort would. A gateway that died
(or whose listener is reconnecting after a Redis outage) has no listener: its ids are taken by whoever sends them
next, and its keys expire within KEY_TTL_S. Without Redis, or while it is down, both fall back to the one gateway:
ids unique on it, Abort reaching only its requests (an id claimed meanwhile is registered by the next renewal).
A tenant with a cap (its key's max_concurrency) has a set of its running ids, `tandem:tenant-requests:<tenant>`, that
the claim counts (those of live gateways) so that the cap holds across the replicas, not per replica.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import redis
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from tandem.sessions.connection import redact_url

log = logging.getLogger(__name__)

KEY_PREFIX = "tandem:request:"
TENANT_PREFIX = "tandem:tenant-requests:"  # a set per tenant with a cap: its running requests' ids, on every replica
CHANNEL_PREFIX = "tandem:abort:"
KEY_TTL_S = 30.0  # a dead gateway's ids are free again this long after its last renewal
RENEW_S = KEY_TTL_S / 3
SOCKET_TIMEOUT_S = 0.3  # a request's claim waits at most this on a Redis that stopped answering
RETRY_S = (0.5, 15.0)  # after a failure Redis is left alone (claims go through unchecked) for 0.5 s, doubling to 15
LISTEN_POLL_S = 1.0
# Connections a replica holds to Redis (the listener's one of them): a burst of requests' claims waits its turn for
# one (each holds it for one round trip) rather than opening a connection each, up to POOL_WAIT_S (64 claims at once,
# p99: 16 ms over 32 connections, 34 ms over 8, in one sitting of request-registry-v1.py).
CONNECTIONS, POOL_WAIT_S = 32, 2.0
RENEW_BATCH = 500

# A claim's value is "<gateway id>:<claim number>": a release deletes only its own claim, so a release that reaches
# Redis after the same gateway took the id again (a client reusing an id at once) leaves the new claim alone.
# Renewal: KEYS are request keys, then the sets of their tenants ("" for none); ARGV[1] the TTL, then per request its
# claim's value and its (scoped) id.
_RENEW = """
local n = #KEYS / 2
for i = 1, n do
  local value = redis.call('GET', KEYS[i])
  if value == false or value == ARGV[2 * i] then
    redis.call('SET', KEYS[i], ARGV[2 * i], 'PX', ARGV[1])
    if KEYS[n + i] ~= '' then
      redis.call('SADD', KEYS[n + i], ARGV[2 * i + 1])
      redis.call('PEXPIRE', KEYS[n + i], ARGV[1])
    end
  end
end
"""
# Free, this gateway's own claim whose release has not reached Redis yet, or the claim of a gateway that no longer
# listens on its channel (killed: its connection closed with it): taken. A live gateway's: refused.
# With a cap (ARGV[5] > 0), the tenant's set (KEYS[2]) counts its requests that run on a live gateway (this one's, or
# one still listening), dropping the others; at the cap: refused (-1).
# KEYS: the request's key, its tenant's set. ARGV: the claim's value, this gateway's "<id>:", the TTL, the channel
# prefix, the tenant's cap (0: none), the request key prefix, the request's (scoped) id.
_CLAIM = """
local function live(value)
  if string.sub(value, 1, string.len(ARGV[2])) == ARGV[2] then return true end
  local owner = string.match(value, '^([^:]*):')
  return owner ~= nil and redis.call('PUBSUB', 'NUMSUB', ARGV[4] .. owner)[2] > 0
end
local value = redis.call('GET', KEYS[1])
if value ~= false and string.sub(value, 1, string.len(ARGV[2])) ~= ARGV[2] and live(value) then return 0 end
local cap = tonumber(ARGV[5])
if cap > 0 then
  local running = 0
  for _, member in ipairs(redis.call('SMEMBERS', KEYS[2])) do
    local held = redis.call('GET', ARGV[6] .. member)
    if held and live(held) then running = running + 1 else redis.call('SREM', KEYS[2], member) end
  end
  if running >= cap then return -1 end
  redis.call('SADD', KEYS[2], ARGV[7])
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return 1
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if KEYS[2] ~= '' then redis.call('SREM', KEYS[2], ARGV[2]) end
end
"""

T = TypeVar("T")
AbortHere = Callable[[str], bool]


class Claim(enum.Enum):
    TAKEN = "taken"  # the request's id is this gateway's while it runs
    ID_IN_USE = "id in use"  # another live gateway runs a request of that id
    TENANT_BUSY = "tenant busy"  # the tenant's requests on every gateway are at its cap


class RequestRegistry(Protocol):
    async def start(self, abort_here: AbortHere) -> None: ...
    async def claim(self, request_id: str, tenant: str = "", cap: int = 0) -> Claim: ...
    async def release(self, request_id: str) -> None: ...
    def release_soon(self, request_id: str) -> None: ...
    async def abort_elsewhere(self, request_id: str) -> bool: ...
    async def close(self) -> None: ...


class LocalRegistry:
    """One gateway alone: the generate path's own map of running ids is the whole registry."""

    async def start(self, abort_here: AbortHere) -> None:
        pass

    async def claim(self, request_id: str, tenant: str = "", cap: int = 0) -> Claim:
        return Claim.TAKEN

    async def release(self, request_id: str) -> None:
        pass

    def release_soon(self, request_id: str) -> None:
        pass

    async def abort_elsewhere(self, request_id: str) -> bool:
        return False

    async def close(self) -> None:
        pass


class RedisRequestRegistry:
    """The registry in Redis; ids are the generate path's scoped ones (a tenant's namespace in front)."""

    def __init__(self, url: str, *, ttl_s: float = KEY_TTL_S, prefix: str = KEY_PREFIX,
                 channel_prefix: str = CHANNEL_PREFIX) -> None:
        self.url, self.ttl_s, self.prefix, self.channel_prefix = url, ttl_s, prefix, channel_prefix
        self.gateway_id = uuid.uuid4().hex
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            url, max_connections=CONNECTIONS, timeout=POOL_WAIT_S, decode_responses=True,
            socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=SOCKET_TIMEOUT_S, retry=Retry(NoBackoff(), 0))
        self._client = redis.asyncio.Redis.from_pool(pool)
        self._claims = itertools.count(1)
        self._held: dict[str, tuple[str, str]] = {}  # request id -> its claim's value and tenant, while it runs here
        self._tasks: set[asyncio.Task] = set()
        self._retry_at, self._retry_s, self._down = 0.0, RETRY_S[0], False
        self.listening = asyncio.Event()  # subscribed to this gateway's channel (again, after an outage)

    @property
    def channel(self) -> str:
        return self.channel_prefix + self.gateway_id

    async def start(self, abort_here: AbortHere) -> None:
        self._spawn(self._listen(abort_here))
        self._spawn(self._renew_forever())

    async def claim(self, request_id: str, tenant: str = "", cap: int = 0) -> Claim:
        """Take `request_id` for this gateway, unless another live gateway runs it or, with a `cap`, `tenant` runs
        that many requests on the gateways together; taken also when Redis cannot say."""
        value = f"{self.gateway_id}:{next(self._claims)}"
        ok, answer = await self._call(lambda client: client.eval(
            _CLAIM, 2, self.prefix + request_id, self._tenant_key(tenant if cap else ""), value,
            f"{self.gateway_id}:", self._ttl_ms, self.channel_prefix, cap, self.prefix, request_id))
        if ok and answer != 1:
            return Claim.ID_IN_USE if answer == 0 else Claim.TENANT_BUSY
        self._held[request_id] = (value, tenant if cap else "")
        return Claim.TAKEN

    def _tenant_key(self, tenant: str) -> str:
        return TENANT_PREFIX + tenant if tenant else ""

    async def release(self, request_id: str) -> None:
        """The request ended here: its key goes, before its client hears so (a client that sends the id again at once,
        to any replica, finds it free). Once per claim: later calls do nothing."""
        held = self._held.pop(request_id, None)
        if held is not None:
            await self._delete(request_id, held)

    def release_soon(self, request_id: str) -> None:
        """release, in the background: for a request that failed or whose client went away (nothing waits on it)."""
        held = self._held.pop(request_id, None)  # now: a claim of the same id made meanwhile is not this one's
        if held is not None:
            self._spawn(self._delete(request_id, held))

    async def _delete(self, request_id: str, held: tuple[str, str]) -> None:
        value, tenant = held
        await self._call(lambda client: client.eval(_RELEASE, 2, self.prefix + request_id, self._tenant_key(tenant),
                                                    value, request_id))

    async def abort_elsewhere(self, request_id: str) -> bool:
        """Tell the gateway running `request_id` to stop it: True when one does (as far as Redis knows)."""
        ok, owner = await self._call(lambda client: client.get(self.prefix + request_id))
        if not ok or owner is None or (gateway := owner.split(":")[0]) == self.gateway_id:
            return False
        ok, listeners = await self._call(lambda client: client.publish(self.channel_prefix + gateway, request_id))
        return bool(ok and listeners)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._held and not self._down:  # a drain that cut requests short: their ids are free at once
            keys = [self.prefix + request_id for request_id in self._held]
            await self._call(lambda client: client.delete(*keys))
        await self._client.aclose()

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    def _spawn(self, work: Awaitable) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _call(self, op: Callable[[redis.asyncio.Redis], Awaitable[T]], *,
                    probe: bool = False) -> tuple[bool, T | None]:
        """(True, op's result); (False, None) when Redis failed or is being left alone after a failure."""
        if self._down and not probe and time.monotonic() < self._retry_at:
            return False, None
        try:
            result = await op(self._client)
        except (redis.RedisError, OSError) as exc:
            if not self._down:
                log.warning("request registry: Redis at %s failed (%s); request ids are checked and Aborts answered "
                            "on this gateway alone until it answers", redact_url(self.url), exc)
            self._down, self._retry_at = True, time.monotonic() + self._retry_s
            self._retry_s = min(RETRY_S[1], self._retry_s * 2)
            return False, None
        if self._down:
            log.warning("request registry: Redis at %s answers again", redact_url(self.url))
            self._down, self._retry_s = False, RETRY_S[0]
        return True, result

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(RENEW_S)
            held = list(self._held.items())
            for start in range(0, len(held), RENEW_BATCH):
                batch = held[start:start + RENEW_BATCH]
                keys = [self.prefix + request_id for request_id, _ in batch]
                keys += [self._tenant_key(tenant) for _, (_, tenant) in batch]
                values = [part for request_id, (value, _) in batch for part in (value, request_id)]
                await self._call(lambda client, keys=keys, values=values: client.eval(
                    _RENEW, len(keys), *keys, self._ttl_ms, *values), probe=True)

    async def _listen(self, abort_here: AbortHere) -> None:
        """Stop what another gateway forwards here; subscribe again after Redis went away."""
        pause = RETRY_S[0]
        while True:
            try:
                async with self._client.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(self.channel)
                    self.listening.set()
                    pause = RETRY_S[0]
                    while True:
                        message = await pubsub.get_message(timeout=LISTEN_POLL_S)
                        if message is not None and message["type"] == "message":
                            abort_here(message["data"])
            except (redis.RedisError, OSError):
                self.listening.clear()
                await asyncio.sleep(pause)
                pause = min(RETRY_S[1], pause * 2)
