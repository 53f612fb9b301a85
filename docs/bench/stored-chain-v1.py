"""Stored responses along one conversation chained by previous_response_id: the store as it was (a module given, e.g.
`git show 73925b6:services/tandem/gateway/openai/stored.py`), each record holding its whole conversation, against the
current one, each response a head and a segment of what it added (gateway.openai.stored_chain). Over a real Redis (the
embedded one) and over memory, in the order old, new, new, old.

Each turn does what a continued request does to the store: read the previous response's conversation (history),
then store the new response (put). Per variant: the bytes the records take (Redis: used_memory's growth and the
records' lengths; memory: the JSON held), the time of a turn at the chain's start and end, and of reading the last
response back (get, what GET .../input_items reads). Every turn's history must be the same under both.

    git show 73925b6:services/tandem/gateway/openai/stored.py > /tmp/stored_old.py
    PYTHONPATH=services python docs/bench/stored-chain-v1.py --old /tmp/stored_old.py --json chain.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import sys
import time

import redis

from tandem.gateway.openai import stored as new
from tandem.sessions import EmbeddedRedis, MemorySessionStore, open_session_store

TENANT = "bench"


def _module(path: str):
    spec = importlib.util.spec_from_file_location("stored_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def _message(item_id: str, role: str, chars: int) -> dict:
    part = "input_text" if role == "user" else "output_text"
    return {"id": item_id, "type": "message", "role": role, "status": "completed",
            "content": [{"type": part, "text": (f"{item_id} " + "lorem ipsum " * chars)[:chars]}]}


def _response(turn: int, previous: str | None, output_chars: int) -> dict:
    return {"id": f"resp_{turn:032x}", "object": "response", "status": "completed", "model": "bench",
            "previous_response_id": previous, "output": [_message(f"msg_out_{turn}", "assistant", output_chars)]}


def _chain(module, raw, turns: int, input_chars: int, output_chars: int) -> tuple[list[float], list[list[dict]]]:
    store = module.ResponseStore(raw)
    seconds, histories, previous = [], [], None

    async def turn_of(turn: int) -> list[dict]:
        history = await store.history(TENANT, previous) if previous else []
        items = history + [_message(f"msg_in_{turn}", "user", input_chars)]
        await store.put(TENANT, module.StoredResponse(_response(turn, previous, output_chars), items))
        return history

    for turn in range(turns):
        started = time.perf_counter()
        histories.append(asyncio.run(turn_of(turn)))
        seconds.append(time.perf_counter() - started)
        previous = f"resp_{turn:032x}"
    return seconds, histories


def _read_seconds(module, raw, last: str, repeats: int = 20) -> float:
    store = module.ResponseStore(raw)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        asyncio.run(store.get(TENANT, last))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run(module, backend: str, url: str, args: argparse.Namespace) -> tuple[dict, list[list[dict]]]:
    client = redis.Redis.from_url(url)
    if backend == "redis":
        client.flushall()
        before = client.info("memory")["used_memory"]
        raw = new.store_beside(open_session_store(url), 3600.0, new.RESPONSE_PREFIX, new.MAX_IN_MEMORY)
    else:
        raw = MemorySessionStore(3600.0, new.MAX_IN_MEMORY)
    seconds, histories = _chain(module, raw, args.turns, args.input_chars, args.output_chars)
    if backend == "redis":
        keys = client.keys(new.RESPONSE_PREFIX + "*")
        held = {"used_memory_growth_bytes": client.info("memory")["used_memory"] - before,
                "record_bytes": sum(client.strlen(key) for key in keys), "records": len(keys)}
    else:
        held = {"record_bytes": sum(len(value) for _, value in raw._items.values()), "records": len(raw._items)}
    tenth = max(1, args.turns // 10)
    result = {**held, "turn_seconds_first_tenth": statistics.median(seconds[:tenth]),
              "turn_seconds_last_tenth": statistics.median(seconds[-tenth:]),
              "get_last_seconds": _read_seconds(module, raw, f"resp_{args.turns - 1:032x}")}
    raw.close()
    return result, histories


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the previous gateway/openai/stored.py")
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--input-chars", type=int, default=300, help="each turn's user message")
    parser.add_argument("--output-chars", type=int, default=1500, help="each turn's answer (about 400 tokens)")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    old = _module(args.old)
    runs, same = [], True
    with EmbeddedRedis() as server:
        for backend in ("redis", "memory"):
            histories = {}
            for name, module in (("old", old), ("new", new), ("new", new), ("old", old)):
                result, histories[name] = run(module, backend, server.url, args)
                runs.append({"backend": backend, "store": name, **result})
                print(json.dumps(runs[-1]), flush=True)
            same = same and histories["old"] == histories["new"]
    summary = {}
    for backend in ("redis", "memory"):
        sides = {name: [r for r in runs if r["backend"] == backend and r["store"] == name] for name in ("old", "new")}
        fields = [field for field in sides["new"][0] if field not in ("backend", "store", "records")]
        summary[backend] = {field: statistics.mean(r[field] for r in sides["old"])
                            / statistics.mean(r[field] for r in sides["new"]) for field in fields}
    out = {"args": vars(args), "histories_identical": same, "runs": runs, "old_over_new": summary}
    with open(args.json, "w") as handle:
        json.dump(out, handle, indent=1)
    print(json.dumps({"histories_identical": same, "old_over_new": summary}, indent=1))


if __name__ == "__main__":
    main()
