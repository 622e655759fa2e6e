#!/usr/bin/env bash
# Builds the servers that the integration and e2e tests and `kernelfleet dev-cluster` run
# (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok, helm, MinIO, the JobSet
# controller, and on request Kueue) from Go modules, into a cache outside the repository. Nothing is
# downloaded as a binary: everything comes from the Go
# module proxy and is compiled with this machine's Go. A binary is rebuilt only when it is
# missing for its pinned version, so a warm run costs nothing.
#
# Usage: build-binaries.sh [--print-dir] [COMPONENT...]   (scripts/build-test-binaries.sh in a checkout)
#   COMPONENT: etcd kube minio kwok helm jobset kueue (default: all but kueue, which only the e2e
#   tier and `dev-cluster up --kueue` need)
set -euo pipefail

K8S_VERSION=1.37.2          # kube-apiserver, kube-controller-manager, kube-scheduler
ETCD_VERSION=3.6.16
KWOK_VERSION=0.8.0
HELM_VERSION=3.22.0
JOBSET_VERSION=0.12.0       # sigs.k8s.io/jobset: a TrainingRun stage is one JobSet
KUEUE_VERSION=0.19.2
# MinIO's tags are not semver, so Go knows it by pseudo-version: this is the repository's final
# commit (2026-02-12), the one the module proxy serves.
MINIO_VERSION=v0.0.0-20260212201848-7aac2a2c5b7c

CACHE="${KERNELFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kernelfleet}"
BIN="$CACHE/bin"
WORK="$CACHE/build"

if [[ "${1:-}" == "--print-dir" ]]; then echo "$BIN"; exit 0; fi

export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-trimpath -buildvcs=false"
mkdir -p "$BIN" "$WORK"

log() { printf '[build-test-binaries] %s\n' "$*" >&2; }

# have NAME VERSION: true when $BIN/NAME was built for VERSION.
have() { [[ -x "$BIN/$1" && "$(cat "$BIN/$1.version" 2>/dev/null)" == "$2" ]]; }
stamp() { echo "$2" > "$BIN/$1.version"; }

# build_wrapped NAME MODULE VERSION PACKAGE: build PACKAGE of MODULE@VERSION into $BIN/NAME from a
# throw-away wrapper module that requires it like any library. For modules `go install` refuses:
# one with local replaces (etcd's server), or one whose version list the proxy will not serve.
build_wrapped() {
  local name=$1 module=$2 version=$3 package=$4 d="$WORK/$1"
  rm -rf "$d"; mkdir -p "$d"; cd "$d"
  go mod init "local.invalid/${name}bin" >/dev/null 2>&1
  go get -tool "$module@v$version" >/dev/null 2>&1
  go build -ldflags "-s -w" -o "$BIN/$name" "$package"
}

build_etcd() {
  have etcd "$ETCD_VERSION" && return 0
  log "building etcd v$ETCD_VERSION"
  build_wrapped etcd go.etcd.io/etcd/server/v3 "$ETCD_VERSION" go.etcd.io/etcd/server/v3
  stamp etcd "$ETCD_VERSION"
}

build_kube() {
  local c all=1
  for c in kube-apiserver kube-controller-manager kube-scheduler; do have "$c" "$K8S_VERSION" || all=0; done
  [[ $all == 1 ]] && return 0
  log "building kube-apiserver, kube-controller-manager, kube-scheduler v$K8S_VERSION"
  local d="$WORK/kube"; rm -rf "$d"; mkdir -p "$d"; cd "$d"
  go mod init local.invalid/kubebins >/dev/null 2>&1
  # k8s.io/kubernetes replaces each staging module with a local path; point every one of
  # them at its published v0.X.Y instead. The list comes from the real go.mod, so a
  # release that adds a staging module needs no change here.
  local gomod staging="0.${K8S_VERSION#1.}" m
  gomod=$(go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  for m in $(sed -nE 's#^[[:space:]]*(k8s\.io/[A-Za-z0-9._-]+)[[:space:]]+=>[[:space:]]+\./staging/.*#\1#p' "$gomod"); do
    go mod edit -replace="$m=$m@v$staging"
  done
  local cmds=(kube-apiserver kube-controller-manager kube-scheduler) pkgs=()
  for c in "${cmds[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$c@v$K8S_VERSION"); done
  go get -tool "${pkgs[@]}" >/dev/null 2>&1
  local ld="-s -w" p date; date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  local minor="${K8S_VERSION#1.}"; minor="${minor%%.*}"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X $p.gitVersion=v$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean -X $p.buildDate=$date"
  done
  for c in "${cmds[@]}"; do
    go build -tags notest -ldflags "$ld" -o "$BIN/$c" "k8s.io/kubernetes/cmd/$c"
    stamp "$c" "$K8S_VERSION"
  done
}

build_kwok() {
  have kwok "$KWOK_VERSION" && return 0
  log "building kwok v$KWOK_VERSION"
  GOBIN="$BIN" go install -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@v$KWOK_VERSION"
  # kwok needs Stage objects (node initialize/heartbeat, pod ready/complete/delete); they ship
  # inside the module, so copy them next to the binary.
  local src stages="$BIN/kwok-stages"; src="$(go env GOMODCACHE)/sigs.k8s.io/kwok@v$KWOK_VERSION/kustomize/stage"
  rm -rf "$stages"; mkdir -p "$stages"
  cp "$src/node/fast/node-initialize.yaml" "$src/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml" \
     "$src/pod/fast/pod-ready.yaml" "$src/pod/fast/pod-complete.yaml" "$src/pod/fast/pod-delete.yaml" "$stages/"
  chmod u+w "$stages"/*
  stamp kwok "$KWOK_VERSION"
}

build_helm() {
  have helm "$HELM_VERSION" && return 0
  log "building helm v$HELM_VERSION"
  local minor="${K8S_VERSION#1.}"; minor="${minor%%.*}"
  GOBIN="$BIN" go install -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=v$HELM_VERSION -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$minor" "helm.sh/helm/v3/cmd/helm@v$HELM_VERSION"
  stamp helm "$HELM_VERSION"
}

build_jobset() {
  have jobset "$JOBSET_VERSION" && return 0
  log "building the JobSet controller v$JOBSET_VERSION"
  build_wrapped jobset sigs.k8s.io/jobset "$JOBSET_VERSION" sigs.k8s.io/jobset
  # Its CRDs and webhook registrations ship inside the module: copy them next to the binary.
  local src manifests="$BIN/jobset-manifests"
  src="$(go env GOMODCACHE)/sigs.k8s.io/jobset@v$JOBSET_VERSION/config/components"
  rm -rf "$manifests"; mkdir -p "$manifests"
  cp "$src"/crd/bases/*.yaml "$src/webhook/manifests.yaml" "$manifests/"
  chmod u+w "$manifests"/*
  stamp jobset "$JOBSET_VERSION"
}

build_minio() {
  have minio "$MINIO_VERSION" && return 0
  log "building minio $MINIO_VERSION"
  GOBIN="$BIN" go install -ldflags "-s -w" "github.com/minio/minio@$MINIO_VERSION"
  stamp minio "$MINIO_VERSION"
}

build_kueue() {
  have kueue "$KUEUE_VERSION" && return 0
  log "building kueue v$KUEUE_VERSION"
  GOBIN="$BIN" go install -ldflags "-s -w" "sigs.k8s.io/kueue/cmd/kueue@v$KUEUE_VERSION"
  # Kueue's CRDs and webhook registrations ship inside the module; the servers install them from
  # here (the webhooks rewritten to point at the local process).
  local src manifests="$BIN/kueue-manifests"; src="$(go env GOMODCACHE)/sigs.k8s.io/kueue@v$KUEUE_VERSION/config/components"
  rm -rf "$manifests"; mkdir -p "$manifests/crd"
  cp "$src"/crd/bases/*.yaml "$manifests/crd/"
  cp "$src/webhook/manifests.yaml" "$manifests/webhooks.yaml"
  chmod -R u+w "$manifests"
  stamp kueue "$KUEUE_VERSION"
}

components=("$@"); [[ ${#components[@]} -gt 0 ]] || components=(kube etcd minio kwok helm jobset)
# Go parallelises each build over the cores already; running the builds side by side also
# overlaps one build's downloads and linking with another's compiling.
declare -A building=()
for c in "${components[@]}"; do
  case "$c" in
    etcd|kube|minio|kwok|helm|jobset|kueue) ( "build_$c" ) & building[$!]=$c ;;
    *) log "unknown component '$c' (expected: etcd kube minio kwok helm jobset kueue)"; exit 2 ;;
  esac
done
# How far it is: each component as it ends, and once a minute what is still compiling (a first
# build compiles every server from source: README.md, "Tests", says how long that takes).
total=${#building[@]} finished=0 rc=0 next=60
while [[ ${#building[@]} -gt 0 ]]; do
  for p in "${!building[@]}"; do
    kill -0 "$p" 2>/dev/null && continue
    if wait "$p"; then state=ready; else state=FAILED; rc=1; fi
    finished=$((finished + 1))
    log "${building[$p]} $state ($finished of $total, ${SECONDS}s)"
    unset "building[$p]"
  done
  if [[ ${#building[@]} -gt 0 && $SECONDS -ge $next ]]; then
    log "still compiling: ${building[*]} ($finished of $total done, ${SECONDS}s)"
    next=$((SECONDS + 60))
  fi
  [[ ${#building[@]} -gt 0 ]] && sleep 1
done
[[ $rc == 0 ]] || { log "a build failed; see the messages above"; exit 1; }
log "binaries ready in $BIN (${SECONDS}s)"
