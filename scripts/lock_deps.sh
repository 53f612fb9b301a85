#!/usr/bin/env bash
# Regenerate the image's hashed lock file: every Python package deploy/Dockerfile installs, at one exact version, with
# the sha256 of each of its files on the index. The image installs it with
#   pip install --require-hashes --no-deps --only-binary=:all: -r deploy/requirements.lock
# so that pip takes no file whose hash is not listed and no package the lock does not name.
#
#   scripts/lock_deps.sh                  deploy/requirements.lock, the default (CUDA 13.0) image, from PyPI alone
#   scripts/lock_deps.sh --variant cpu    deploy/requirements-cpu.lock (also cu126, ...), torch from PyTorch's index
#
# What is locked: pyproject.toml's dependencies, its `server` extra and its `cpu` extra (Intel's OpenMP runtime, which
# the chart preloads on CPU pools), ray[default] (the dashboard agent KubeRay's probes and Ray's Prometheus export
# need) and pyproject's build requirements (the image builds tandem itself with
# --no-build-isolation, so that setuptools and wheel come from the lock too). Resolved for the image's interpreter and
# platform: CPython 3.11 (FROM python:3.11-slim) on Linux x86_64 (glibc). PyPI's torch for Linux x86_64 is the CUDA
# 13.0 build, which is the default image's cu130; other variants resolve torch==<version>+<variant> from
# https://download.pytorch.org/whl/<variant> first (then PyPI) and record both indexes in their lock.
#
# The resolver is uv (PyPI: uv), pinned here; where no uv is on PATH it is installed into a throwaway venv.
# Re-run after changing pyproject.toml's dependencies or the torch pin, and commit the lock with that change
# (tests/test_deploy_lock.py checks that every dependency is pinned and hashed).
set -euo pipefail

UV_VERSION=0.13.9
PYTHON_VERSION=3.11
PLATFORM=x86_64-manylinux_2_31  # python:3.11-slim is Debian 12 (glibc 2.36); llguidance ships 2_31 wheels only
RAY_IMAGE_REQUIREMENT='ray[default]'  # its version range is the server extra's

variant=cu130
while [[ $# -gt 0 ]]; do
    case "$1" in
        --variant) variant="${2:?--variant needs a value: cu130, cu126, cpu, ...}"; shift 2 ;;
        -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;;  # the comment above
        *) echo "lock_deps.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

cd "$(dirname "$0")/.."
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

uv="$(command -v uv || true)"
if [[ -z "$uv" || "$("$uv" --version | awk '{print $2}')" != "$UV_VERSION" ]]; then
    python3 -m venv "$work/uv-venv"
    "$work/uv-venv/bin/pip" install --quiet --disable-pip-version-check "uv==$UV_VERSION"
    uv="$work/uv-venv/bin/uv"
fi

# The torch pin is the server extra's (torch==X); a variant other than PyPI's default adds its local label (X+cpu).
torch_pin="$(python3 -c 'import tomllib, sys
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["server"]
print(next(d.split("==")[1].strip() for d in deps if d.replace(" ", "").startswith("torch==")))')"
build_requires="$(python3 -c 'import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))')"

if [[ "$variant" == cu130 ]]; then
    output=deploy/requirements.lock
    indexes=(--index-url https://pypi.org/simple)
    torch_requirement="torch==$torch_pin"
else
    output="deploy/requirements-$variant.lock"
    indexes=(--index-url "https://download.pytorch.org/whl/$variant" --extra-index-url https://pypi.org/simple
             --emit-index-url)
    torch_requirement="torch==$torch_pin+$variant"
fi

printf '%s\n' "$RAY_IMAGE_REQUIREMENT" "$torch_requirement" "$build_requires" > "$work/image.in"
# From standard input, so that the lock's "# via" notes name no temporary file.
"$uv" pip compile pyproject.toml - --extra server --extra cpu \
    --generate-hashes --only-binary :all: \
    --python-version "$PYTHON_VERSION" --python-platform "$PLATFORM" \
    "${indexes[@]}" --no-config \
    --custom-compile-command "scripts/lock_deps.sh$([[ $variant == cu130 ]] || echo " --variant $variant")" \
    --output-file "$output" --quiet < "$work/image.in"
echo "wrote $output ($(grep -c '^[A-Za-z0-9]' "$output") packages)"
