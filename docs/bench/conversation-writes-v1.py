"""What an atomic conversation write costs, and what it keeps: a conversation changed as one optimistic Redis
transaction (RedisSessionStore.update: WATCH, GET, MULTI SET EXEC) against the plain read then write it replaced
(get, then put), on a Redis of the bench's own.

1. Alone: one conversation of `items` items (each a 300-character message) gains one item, each way, the two ways
   alternating, median of 200 (milliseconds).
2. At once: 2 replicas (2 stores), 2 threads each, 50 one-item appends per thread to one conversation, each way:
   items that landed out of the 200 appended, how many times `change` ran per update (1: no retry), seconds.

    PYTHONPATH=services python docs/bench/conversation-writes-v1.py docs/bench/conversation-writes-v1.json  # ~1 min
"""
import json
import statistics
import sys
import threading
import time

from tandem.sessions import EmbeddedRedis, RedisSessionStore

ITEM = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x" * 300}]}


def appended(calls: list[int] | None = None):
    def change(record: dict | None) -> dict:
        if calls is not None:
            calls.append(1)
        record["items"].append(ITEM)
        return record

    return change


def read_then_write(store: RedisSessionStore, key: str, change) -> None:
    store.put(key, change(store.get(key)))


def alone(url: str, items: int) -> dict:
    store = RedisSessionStore(url, ttl_s=600)
    times: dict[str, list[float]] = {"transaction": [], "read_then_write": []}
    for n in range(200):
        for way in (("transaction", "read_then_write") if n % 2 else ("read_then_write", "transaction")):
            store.put("alone", {"items": [ITEM] * items})
            started = time.perf_counter()
            if way == "transaction":
                store.update("alone", appended())
            else:
                read_then_write(store, "alone", appended())
            times[way].append(time.perf_counter() - started)
    store.close()
    medians = {way: round(statistics.median(values) * 1000, 3) for way, values in times.items()}
    return {"items": items, "median_ms": medians,
            "transaction_over_read_then_write": round(medians["transaction"] / medians["read_then_write"], 3)}


def at_once(url: str, way: str) -> dict:
    replicas = [RedisSessionStore(url, ttl_s=600) for _ in range(2)]
    replicas[0].put(way, {"items": []})
    calls: list[int] = []
    barrier = threading.Barrier(4)

    def run(store: RedisSessionStore) -> None:
        barrier.wait()
        for _ in range(50):
            if way == "transaction":
                store.update(way, appended(calls))
            else:
                read_then_write(store, way, appended(calls))

    threads = [threading.Thread(target=run, args=(store,)) for store in replicas for _ in range(2)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    landed = len(replicas[0].get(way)["items"])
    for store in replicas:
        store.close()
    return {"appended": 200, "landed": landed, "change_runs_per_update": round(len(calls) / 200, 3),
            "seconds": round(seconds, 3)}


def main(out: str) -> None:
    with EmbeddedRedis() as redis:
        result = {"alone": [alone(redis.url, items) for items in (2, 20, 200)],
                  "at_once": {way: at_once(redis.url, way) for way in ("read_then_write", "transaction")}}
    print(json.dumps(result, indent=1))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
