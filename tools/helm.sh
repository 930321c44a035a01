#!/usr/bin/env bash
# Print the path of a helm binary, building it once with `go install` (from the Go module proxy)
# into the cache when there is none: helm is not in PyPI or Debian, and no other download source
# is reachable here.
#
#   tools/helm.sh            -> path of helm (builds it the first time: ~5 min on 2 cores, then 0 s)
#   $(tools/helm.sh) lint helm/kv-event-bridge
#
# Environment: KVB_HELM (use this binary), KVB_HELM_VERSION (default below), KVB_CACHE_DIR
# (default ~/.cache/kv-event-bridge; the binary goes to $KVB_CACHE_DIR/bin/helm-VERSION).
#
# The ldflags are the ones helm's own Makefile sets: without them a `go install`ed helm reports
# version "v3.22" and, worse, assumes Kubernetes 1.20 as the default cluster version, so any chart
# with kubeVersion >= 1.21 fails to render.
set -euo pipefail

if [[ -n "${KVB_HELM:-}" ]]; then
  echo "$KVB_HELM"
  exit 0
fi

version="${KVB_HELM_VERSION:-v3.22.0}"
# Kubernetes version of the client-go that helm $version is built with (its go.mod: k8s.io/client-go v0.37.x).
k8s_minor="${KVB_HELM_K8S_MINOR:-37}"
cache="${KVB_CACHE_DIR:-$HOME/.cache/kv-event-bridge}"
bin="$cache/bin/helm-$version"

if [[ -x "$bin" ]]; then
  echo "$bin"
  exit 0
fi

command -v go >/dev/null || { echo "tools/helm.sh: no 'go' on PATH to build helm $version" >&2; exit 1; }
mkdir -p "$cache/bin"
tmp="$(mktemp -d "$cache/bin/.helm-build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

echo "tools/helm.sh: building helm $version with go install (once; cached at $bin)" >&2
start=$SECONDS
ldflags="-w -s"
ldflags+=" -X helm.sh/helm/v3/internal/version.version=$version"
ldflags+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for pkg in pkg/lint/rules pkg/chartutil; do
  ldflags+=" -X helm.sh/helm/v3/$pkg.k8sVersionMajor=1 -X helm.sh/helm/v3/$pkg.k8sVersionMinor=$k8s_minor"
done
GOBIN="$tmp" CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -trimpath" \
  go install -ldflags "$ldflags" "helm.sh/helm/v3/cmd/helm@$version" >&2
# Renamed into place only when complete, so an interrupted build is never mistaken for a binary.
mv "$tmp/helm" "$bin"
echo "tools/helm.sh: built $("$bin" version --short) in $((SECONDS - start)) s" >&2
echo "$bin"
