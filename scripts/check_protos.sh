#!/usr/bin/env bash
# The public API's checks: buf lint (STANDARD) and buf breaking (FILE rules).
#
#   scripts/check_protos.sh             # breaking against protos/tandem-v1.binpb, the frozen v1 contract
#   scripts/check_protos.sh REF         # breaking against the protos of a git ref too (e.g. origin/main)
#   scripts/check_protos.sh --freeze    # rewrite protos/tandem-v1.binpb from the current protos (after review)
#
# The frozen image changes only by --freeze, so an accidental rename or renumbering fails CI however many commits
# it is spread over; adding fields, messages and calls passes.
set -euo pipefail
cd "$(dirname "$0")/.."
BUF="${TANDEM_BUF:-.venv/bin/buf}"
BASELINE=protos/tandem-v1.binpb

if [ "${1:-}" = "--freeze" ]; then
    "$BUF" build protos -o "$BASELINE"
    echo "check_protos.sh: froze the current protos into $BASELINE"
    exit 0
fi
"$BUF" lint protos
"$BUF" breaking protos --against "$BASELINE"
if [ -n "${1:-}" ]; then
    "$BUF" breaking protos --against ".git#ref=$1,subdir=protos"
fi
echo "check_protos.sh: buf lint and buf breaking passed"
