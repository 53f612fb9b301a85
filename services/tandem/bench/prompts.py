"""The benchmarks' shipped prompt sets, and loading the one `--prompts` names (or a JSONL file).

Standard library only, so that a benchmark's parser, and `tandem bench --help`, stay cheap to build: pass PROMPT_SETS
and DEFAULT_PROMPTS to tandem.cli.options.add_prompts_option.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from tandem.errors import InvalidArgument

# Shipped sets, by the name `--prompts` takes: the file in this package that holds each.
PROMPT_SETS: dict[str, str] = {"bench": "prompts.jsonl"}  # 8 short coding requests, sent as one user chat message each
DEFAULT_PROMPTS = "bench"


def load_prompts(source: str | Path | None = None) -> list[str]:
    """The prompt texts of a shipped set (PROMPT_SETS, by name; None: DEFAULT_PROMPTS) or of a JSONL file with one
    {"prompt": ...} per line."""
    source = DEFAULT_PROMPTS if source is None else source
    if isinstance(source, str) and source in PROMPT_SETS:
        text = resources.files("tandem.bench").joinpath(PROMPT_SETS[source]).read_text()
    else:
        path = Path(source)
        if not path.is_file():
            raise InvalidArgument(f"prompts: {source!r} is neither a shipped set ({', '.join(PROMPT_SETS)}) nor a file")
        text = path.read_text()
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            prompts.append(str(json.loads(line)["prompt"]))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise InvalidArgument(f"prompts: line {number} is not a JSON object with a 'prompt' field") from exc
    if not prompts:
        raise InvalidArgument("prompts: the file holds no prompts")
    return prompts
