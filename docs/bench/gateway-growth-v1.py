"""Whether a gateway's Python objects grow over many requests: soak-v1.py's request mix with its 64 fixed sessions
(a third continue a session, a third share a prefix, a sixteenth cancelled mid-stream; 12 greedy tokens, 8 in flight
over gRPC) against a gateway in this process over the tiny pair (the engine in process, not over Ray). After N warm-up
requests tracemalloc starts; its snapshots after N and 2N more requests are compared with the first: the traced
growth, its largest places, and the process's resident memory. Traced growth flat while resident memory creeps says
the creep is below Python (the allocator, native libraries).

    PYTHONPATH=services python docs/bench/gateway-growth-v1.py growth.json [N]     # N 3000: about 20 min on CPU-A
"""
import gc
import json
import random
import sys
import tempfile
import threading
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # its gateway harness
import grpc
import psutil
import torch

from gateway_harness import ServerThread, tiny_backend
from tandem.client import TandemClient
from tandem.models.loader import load_model
from tandem.models.tiny import make_tiny

N = int(sys.argv[2]) if len(sys.argv) > 2 else 3000


def one(client, n, rng, lock):
    kind = n % 3
    prompt = [rng.randrange(3, 250) for _ in range(rng.randrange(4, 40))]
    options = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, "request_id": f"soak-{n}"}
    if kind == 0:
        options["session_id"] = f"s{n % 64}"
    elif kind == 1:
        prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18] + prompt
    stream = client.generate(token_ids=prompt, **options)
    try:
        for index, _ in enumerate(stream):
            if n % 16 == 5 and index == 2:
                stream.close()
                break
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:
            raise


with tempfile.TemporaryDirectory() as scratch:
    tiny = make_tiny(Path(scratch) / "tiny", seed=0)
    target = load_model(str(tiny.target), device=torch.device("cpu"), dtype=torch.float32)
    draft = load_model(str(tiny.draft), device=torch.device("cpu"), dtype=torch.float32)
    server = ServerThread(tiny_backend(target, draft))
    rng, lock = random.Random(0), threading.Lock()
    proc = psutil.Process()
    with TandemClient(server.address, timeout=120) as client, ThreadPoolExecutor(8) as pool:
        def run(start, count):
            list(pool.map(lambda n: one(client, n, rng, lock), range(start, start + count)))
        run(0, N)  # warm

        def snapshot() -> tuple[tracemalloc.Snapshot, int]:
            gc.collect()
            taken = tracemalloc.take_snapshot().filter_traces((tracemalloc.Filter(False, tracemalloc.__file__),))
            return taken, proc.memory_info().rss  # (less the snapshots' own memory)

        gc.collect()
        tracemalloc.start(12)
        first, rss0 = snapshot()
        run(N, N)
        mid, rss1 = snapshot()
        run(2 * N, N)
        last, rss2 = snapshot()

    def growth(a, b) -> dict:
        stats = b.compare_to(a, "traceback")
        return {"traced_kib": round(sum(s.size_diff for s in stats) / 1024, 1),
                "largest": [{"kib": round(s.size_diff / 1024, 1), "objects": s.count_diff,
                             "where": [f"{frame.filename.split('/site-packages/')[-1].split('/services/')[-1]}:"
                                       f"{frame.lineno}" for frame in s.traceback][-4:]} for s in stats[:8]]}

    record = {"n": N, "rss_mb": [round(rss / 2**20, 1) for rss in (rss0, rss1, rss2)],
              "first_to_mid": growth(first, mid), "mid_to_last": growth(mid, last),
              "first_to_last": growth(first, last)}
    Path(sys.argv[1]).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({key: record[key] for key in ("n", "rss_mb")} | {
        key: record[key]["traced_kib"] for key in ("first_to_mid", "mid_to_last", "first_to_last")}))
    server.stop()
