#!/usr/bin/env bash
# Install the CRD schemas the chart's custom resources are validated against (tests/test_helm_crds.py, through
# scripts/validate_crds.mjs): scripts/install_crd_schemas.sh [DEST]   (default DEST: .venv/crd-schemas)
#
# kubernetes-validate knows core kinds only. These npm packages carry validators generated from the projects' own
# CRD schemas (prometheus-operator's ServiceMonitor, PodMonitor, PrometheusRule; cert-manager's Certificate; the
# Gateway API's GRPCRoute and HTTPRoute): required fields, types, enums and patterns, not unknown fields (a CRD
# schema admits those; the API server prunes them). KubeRay's RayCluster has no such package. A second run with the
# pinned versions in place does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=("@kubernetes-models/prometheus-operator@6.0.0" "@kubernetes-models/cert-manager@6.0.0"
          "@kubernetes-models/gateway-api@2.0.0")
DEST="${1:-.venv/crd-schemas}"

installed() {
    local spec name version
    for spec in "${PACKAGES[@]}"; do
        name="${spec%@*}" version="${spec##*@}"
        grep -q "\"version\": \"$version\"" "$DEST/node_modules/$name/package.json" 2>/dev/null || return 1
    done
}

if installed; then
    exit 0
fi
command -v npm >/dev/null || { echo "install_crd_schemas.sh: npm is needed (Debian's npm)" >&2; exit 1; }
mkdir -p "$DEST"
npm install --prefix "$DEST" --silent --no-audit --no-fund --no-save "${PACKAGES[@]}" >/dev/null
installed || { echo "install_crd_schemas.sh: $DEST lacks the pinned packages after npm install" >&2; exit 1; }
echo "install_crd_schemas.sh: ${PACKAGES[*]} in $DEST"
