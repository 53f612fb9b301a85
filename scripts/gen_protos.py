"""Regenerate the Python gRPC code for protos/ into services/tandem/ (or, with --check, verify it is current).

    python scripts/gen_protos.py          # rewrite services/tandem/v1/generation_pb2{.py,.pyi,_grpc.py}
    python scripts/gen_protos.py --check  # exit 1 if the committed files differ from a fresh generation

The proto path is protos/, so generated imports read `from tandem.v1 import ...` and resolve inside the package.
The output depends on the grpcio-tools version, which pyproject.toml pins exactly.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE_ROOT = ROOT / "services"
PROTOS = ("tandem/v1/generation.proto",)
LINT_HEADER = "# ruff: noqa\n"


def generated_names(proto: str) -> list[str]:
    stem = proto.removesuffix(".proto")
    return [f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"]


def generate(out_dir: Path) -> list[Path]:
    """Run protoc for every proto into out_dir; return the generated files relative to out_dir."""
    from grpc_tools import protoc

    include = resources.files("grpc_tools") / "_proto"
    for proto in PROTOS:
        status = protoc.main([
            "grpc_tools.protoc",
            f"--proto_path={PROTO_ROOT}",
            f"--proto_path={include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(PROTO_ROOT / proto),
        ])
        if status != 0:
            raise SystemExit(f"protoc failed on {proto} (status {status})")
    files = [Path(name) for proto in PROTOS for name in generated_names(proto)]
    for relative in files:
        path = out_dir / relative
        # Generated code is not held to the project's lint rules.
        path.write_text(LINT_HEADER + path.read_text())
    return files


def differences(fresh_dir: Path, files: list[Path]) -> list[str]:
    problems = []
    for relative in files:
        fresh = (fresh_dir / relative).read_text()
        committed_path = PACKAGE_ROOT / relative
        if not committed_path.exists():
            problems.append(f"{committed_path.relative_to(ROOT)} is missing")
            continue
        committed = committed_path.read_text()
        if committed != fresh:
            diff = difflib.unified_diff(committed.splitlines(), fresh.splitlines(), "committed", "fresh", lineterm="")
            problems.append(f"{committed_path.relative_to(ROOT)} is stale:\n" + "\n".join(list(diff)[:40]))
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="verify the committed code instead of rewriting it")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp)
        files = generate(out_dir)
        if args.check:
            problems = differences(out_dir, files)
            for problem in problems:
                print(problem, file=sys.stderr)
            if problems:
                print("run: python scripts/gen_protos.py", file=sys.stderr)
                return 1
            print(f"{len(files)} generated files are up to date")
            return 0
        for relative in files:
            target = PACKAGE_ROOT / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text((out_dir / relative).read_text())
            print(f"wrote {target.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
