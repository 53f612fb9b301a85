"""What the cross-replica request registry (gateway.request_registry) costs a request, and how fast an Abort reaches
another replica, against a real redis-server on loopback (an embedded one, as `tandem serve` starts).

- claim and release: one request's claim (the atomic script run before it is queued) and release (run before its
  last event is sent), CLAIMS of each one after another, and CLAIMS in waves of CONCURRENT at once (a burst);
- a capped tenant's claim, with CONCURRENT - 1 of its requests running (the claim counts them);
- forward: an Abort forwarded to another registry (GET the owner, PUBLISH on its channel) until the owner's listener
  has the id: what a client's Abort adds on the replica it reached.

    PYTHONPATH=services python docs/bench/request-registry-v1.py out.json     # ~10 s
"""
import argparse
import asyncio
import json
import platform
import statistics
import time

from tandem.gateway.request_registry import Claim, RedisRequestRegistry
from tandem.sessions import EmbeddedRedis

CLAIMS, CONCURRENT, FORWARDS = 2000, 64, 500


def summary(seconds: list[float]) -> dict:
    ms = sorted(1000 * value for value in seconds)
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 4), "p99_ms": round(ms[int(0.99 * len(ms))], 4),
            "mean_ms": round(statistics.fmean(ms), 4)}


async def measure(url: str) -> dict:
    owner, other = RedisRequestRegistry(url), RedisRequestRegistry(url)
    arrived: asyncio.Queue[str] = asyncio.Queue()
    await owner.start(lambda request_id: arrived.put_nowait(request_id) is None)
    await other.start(lambda request_id: False)
    await asyncio.wait_for(owner.listening.wait(), 10)

    async def timed(call) -> float:
        started = time.perf_counter()
        await call
        return time.perf_counter() - started

    sequential, released = [], []
    for index in range(CLAIMS):
        sequential.append(await timed(owner.claim(f"seq-{index}")))
        released.append(await timed(owner.release(f"seq-{index}")))

    burst, burst_released = [], []
    for wave in range(CLAIMS // CONCURRENT):
        ids = [f"burst-{wave}-{index}" for index in range(CONCURRENT)]
        burst += await asyncio.gather(*(timed(owner.claim(request_id)) for request_id in ids))
        burst_released += await asyncio.gather(*(timed(owner.release(request_id)) for request_id in ids))

    # A tenant with a cap: each claim counts the tenant's running requests (here CONCURRENT - 1 of them, live).
    running = [f"t:held-{index}" for index in range(CONCURRENT - 1)]
    for request_id in running:
        assert await owner.claim(request_id, "t", CONCURRENT) is Claim.TAKEN
    capped = []
    for index in range(CLAIMS // 4):
        capped.append(await timed(owner.claim(f"t:capped-{index}", "t", CONCURRENT)))
        await owner.release(f"t:capped-{index}")
    for request_id in running:
        await owner.release(request_id)

    forwards = []
    for index in range(FORWARDS):
        assert await owner.claim(f"run-{index}") is Claim.TAKEN
        started = time.perf_counter()
        assert await other.abort_elsewhere(f"run-{index}")
        assert await asyncio.wait_for(arrived.get(), 5) == f"run-{index}"
        forwards.append(time.perf_counter() - started)
        await owner.release(f"run-{index}")
    await owner.close()
    await other.close()
    return {"claim_sequential": summary(sequential), "release_sequential": summary(released),
            f"claim_tenant_capped_{CONCURRENT - 1}_running": summary(capped),
            f"claim_{CONCURRENT}_at_once": summary(burst), f"release_{CONCURRENT}_at_once": summary(burst_released),
            "abort_forwarded_until_owner_has_it": summary(forwards)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    args = parser.parse_args()
    with EmbeddedRedis() as server:
        results = asyncio.run(measure(server.url))
    report = {"machine": platform.processor() or platform.machine(), "redis": "embedded redis-server, loopback",
              **results}
    print(json.dumps(report, indent=1))
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
