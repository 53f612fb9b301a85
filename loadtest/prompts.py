"""The shipped prompt sets (loadtest/prompts/*.jsonl) and the order a run draws them in.

code.jsonl rows: {"id", "kind": "code", "length": "short"|"medium"|"long", "prompt"}: sent as raw prompt text.
chat.jsonl rows: {"id", "kind": "chat", "length", "messages": [{"role", "content"}, ...]}: sent as Chat messages, so
the server applies the model's chat template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PROMPT_DIR = Path(__file__).resolve().parent / "prompts"
SETS = ("code", "chat", "mixed")
LENGTHS = ("short", "medium", "long")


@dataclass(slots=True, frozen=True)
class Prompt:
    id: str
    kind: str  # "code" or "chat"
    length: str  # "short", "medium" or "long"
    text: str | None = None  # code: raw prompt text
    messages: tuple[tuple[str, str], ...] = ()  # chat: (role, content) pairs

    def request_input(self) -> dict:
        """The input keyword for tandem.client.build_request: prompt=... or chat=[...]."""
        if self.kind == "chat":
            return {"chat": list(self.messages)}
        return {"prompt": self.text}

    @property
    def chars(self) -> int:
        return len(self.text) if self.text is not None else sum(len(c) for _, c in self.messages)


def _parse(row: dict, where: str) -> Prompt:
    kind, length = row.get("kind"), row.get("length")
    if kind not in ("code", "chat") or length not in LENGTHS or not row.get("id"):
        raise ValueError(f"{where}: needs id, kind (code|chat) and length (short|medium|long)")
    if kind == "chat":
        messages = tuple((m["role"], m["content"]) for m in row.get("messages", []))
        if not messages:
            raise ValueError(f"{where}: a chat prompt needs messages")
        return Prompt(row["id"], kind, length, messages=messages)
    if not row.get("prompt"):
        raise ValueError(f"{where}: a code prompt needs prompt text")
    return Prompt(row["id"], kind, length, text=row["prompt"])


def load_file(path: Path) -> list[Prompt]:
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            prompts.append(_parse(json.loads(line), f"{path.name}:{number}"))
    return prompts


def load_set(name: str, lengths: tuple[str, ...] = LENGTHS, directory: Path = PROMPT_DIR) -> list[Prompt]:
    """Prompts of one shipped set ("code", "chat" or "mixed" = both), keeping only the given lengths."""
    if name not in SETS:
        raise ValueError(f"must be one of {', '.join(SETS)}, got {name!r}")
    if unknown := [length for length in lengths if length not in LENGTHS]:
        raise ValueError(f"unknown length {unknown[0]!r} (expected {', '.join(LENGTHS)})")
    files = ("code", "chat") if name == "mixed" else (name,)
    prompts = [p for f in files for p in load_file(directory / f"{f}.jsonl") if p.length in lengths]
    if not prompts:
        raise ValueError(f"no {name} prompts of length {', '.join(lengths)}")
    return prompts


def schedule(prompts: list[Prompt], count: int, seed: int = 0) -> list[Prompt]:
    """`count` prompts: passes over the set, each pass in a fresh seeded order, so every prompt is used about
    equally and two runs with one seed (e.g. speculation AUTO and OFF) send the same prompts in the same order."""
    generator = np.random.default_rng([seed, 1])  # a stream of its own, apart from the arrival gaps'
    order: list[Prompt] = []
    while len(order) < count:
        order.extend(prompts[i] for i in generator.permutation(len(prompts)))
    return order[:count]
