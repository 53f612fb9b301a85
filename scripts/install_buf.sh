#!/usr/bin/env bash
# Install a pinned buf binary for the proto checks: scripts/install_buf.sh [DEST]   (default DEST: .venv/bin/buf)
#
# buf ships on npm: @bufbuild/buf-linux-x64 holds bin/buf, a static linux-amd64 binary. npm checks the tarball's
# integrity; this script checks the binary's sha256. A second run with the binary in place only compares it.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGE="@bufbuild/buf-linux-x64@1.75.0"
BUF_SHA256="fad1e38d6909bbb583a4da81d8c02a01046e2cd663bde7e337dd24277393764b"
DEST="${1:-.venv/bin/buf}"

sha_ok() { [ -f "$1" ] && echo "$BUF_SHA256  $1" | sha256sum --check --status; }

if sha_ok "$DEST"; then
    exit 0
fi
if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
    echo "install_buf.sh: the packaged buf is linux-amd64 only; install buf 1.75.0 yourself and set TANDEM_BUF" >&2
    exit 1
fi
command -v npm >/dev/null || { echo "install_buf.sh: npm is needed to fetch $PACKAGE" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$PACKAGE" >/dev/null)
tar -xzf "$work"/*.tgz -C "$work" package/bin/buf
sha_ok "$work/package/bin/buf" || { echo "install_buf.sh: checksum mismatch for $PACKAGE" >&2; exit 1; }
mkdir -p "$(dirname "$DEST")"
install -m 0755 "$work/package/bin/buf" "$DEST"
echo "install_buf.sh: buf $("$DEST" --version) at $DEST"
