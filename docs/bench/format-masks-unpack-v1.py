"""How core/format_masks.py turns llguidance's bitmasks into masked logits, against the obvious alternatives: 40
positions (8 rows x k + 1 = 5) of a 151,936-id vocabulary, random bitmasks, torch on 2 threads; median of 4 rounds
of 10 calls each, the two forms of each pair alternated.

    PYTHONPATH=services python docs/bench/format-masks-unpack-v1.py format-masks-unpack.json
"""
import json
import sys
import time

import torch

from tandem.core.format_masks import _unpack

torch.set_num_threads(2)
ROWS, VOCAB = 40, 151936
masks = torch.randint(-2**31, 2**31 - 1, (ROWS, (VOCAB + 31) // 32), dtype=torch.int32)
logits = torch.randn(ROWS, VOCAB)
allowed = _unpack(masks, VOCAB)
rows = torch.arange(ROWS)


def unpack_by_shifts() -> torch.Tensor:
    shifts = torch.arange(32, dtype=torch.int32)
    return ((masks.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()[:, :VOCAB]


def unpack_by_byte_lookup() -> torch.Tensor:  # what core/format_masks.py does
    return _unpack(masks, VOCAB)


def fill_by_row_index() -> torch.Tensor:
    out = logits.to(torch.float32, copy=True)
    out[rows] = out[rows].masked_fill_(~allowed, float("-inf"))
    return out


def fill_by_where() -> torch.Tensor:  # what core/format_masks.py does
    return torch.where(allowed, logits, float("-inf"))


assert torch.equal(unpack_by_shifts(), unpack_by_byte_lookup())
assert torch.equal(fill_by_row_index(), fill_by_where())
medians = {}
for pair in ((unpack_by_shifts, unpack_by_byte_lookup), (fill_by_row_index, fill_by_where)):
    times: dict[str, list[float]] = {f.__name__: [] for f in pair}
    for round_ in range(4):
        for f in pair if round_ % 2 == 0 else pair[::-1]:
            f()
            started = time.perf_counter()
            for _ in range(10):
                f()
            times[f.__name__].append((time.perf_counter() - started) * 100)
    medians.update({name: round(sorted(t)[len(t) // 2], 3) for name, t in times.items()})
report = {"rows": ROWS, "vocab": VOCAB, "threads": 2, "ms_median": medians}
print(json.dumps(report))
with open(sys.argv[1], "w") as sink:
    json.dump(report, sink, indent=1)
