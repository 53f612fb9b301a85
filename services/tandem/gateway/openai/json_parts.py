"""A whole response's JSON body, byte for byte as JSONResponse renders it, encoded in calls of bounded size.

json's C encoder holds the GIL for a whole call. A completion of 16 choices echoing a 3000-token prompt with 20
logprobs a token is 29.8 MB of JSON, 1.9 MB a choice: encoded a choice a call (40-70 ms each), each GIL hand-over the
event loop's thread waited for could last that long, and a health check needs several. So a value is encoded whole
only where it holds fewer than `PART_ELEMENTS` values (containers and scalars alike; up to 11 ms of encoding here); a
larger dict is descended a key at a time, a list encoded as runs of consecutive items sized to stay under the bound
(docs/performance.md, "Prompt logprobs and echo": 5,000 read worse, 60,000 took twice as long to encode).
"""

from __future__ import annotations

import json

PART_ELEMENTS = 20_000


def json_in_parts(payload: object) -> bytes:
    """`payload` as JSONResponse renders it (compact separators, non-ASCII kept, no NaN)."""
    parts: list[bytes] = []
    _encode(payload, parts)
    return b"".join(parts)


def _encode(value: object, parts: list[bytes]) -> None:
    if isinstance(value, (list, tuple)):
        _encode_items(value, parts)
    elif not isinstance(value, dict) or _elements(value, PART_ELEMENTS) < PART_ELEMENTS:
        parts.append(_json(value))
    elif not all(isinstance(key, str) for key in value):
        parts.append(_json(value))  # json turns other keys into strings its own way (1.0 -> "1.0"): left to it
    else:
        parts.append(b"{")
        for index, (key, item) in enumerate(value.items()):
            parts.append((b"," if index else b"") + _json(key) + b":")
            _encode(item, parts)
        parts.append(b"}")


def _encode_items(items: list | tuple, parts: list[bytes]) -> None:
    """A list as runs of consecutive items, each run one call (json.dumps of the run without its brackets), as many
    items a run as the run's first item's size leaves under the bound (a response's long lists hold items of one
    shape: a token's logprobs); an item at the bound or over it is descended on its own."""
    parts.append(b"[")
    start = 0
    while start < len(items):
        size = _elements(items[start], PART_ELEMENTS)
        parts.append(b"," if start else b"")
        if size >= PART_ELEMENTS:
            _encode(items[start], parts)
            start += 1
        else:
            run = items[start:start + max(PART_ELEMENTS // size, 1)]
            parts.append(_json(run)[1:-1])
            start += len(run)
    parts.append(b"]")


def _elements(value: object, bound: int) -> int:
    """How many values `value` holds, itself included, counted up to `bound` (a walk that stops there)."""
    count, stack = 0, [value]
    while stack and count < bound:
        item = stack.pop()
        count += 1
        if type(item) is dict:
            stack.extend(item.values())
        elif type(item) is list or type(item) is tuple:
            stack.extend(item)
    return count


def _json(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")
