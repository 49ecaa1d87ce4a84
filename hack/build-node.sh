#!/usr/bin/env bash
# Builds what a real Kubernetes node needs beside the API server:
# kubelet, kube-controller-manager, kube-scheduler and kube-proxy from k8s.io/kubernetes
# (the same recipe as build-kube.sh), and containerd v2 with its runc shim
# from github.com/containerd/containerd/v2, all through the Go module proxy.
# runc, the CNI plugins and iptables come from Debian's packages (installed
# by `make deps-node`). The binaries land in $OUT (e.g. bin/node/1.37.2-containerd2.4.2).
#
# usage: hack/build-node.sh KUBE_VERSION CONTAINERD_VERSION OUT
set -euo pipefail

kube_version=${1:?kube version, e.g. 1.37.2}
containerd_version=${2:?containerd version, e.g. 2.4.2}
out=${3:?output folder}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# shellcheck source=hack/kube-module.sh
source "$(dirname "$0")/kube-module.sh"

cmds=(kubelet kube-controller-manager kube-scheduler kube-proxy)
missing=()
for c in "${cmds[@]}"; do [[ -x $out/$c ]] || missing+=("$c"); done
if ((${#missing[@]})); then
  echo ">> building ${missing[*]} v$kube_version (about 4 minutes on 2 cores)"
  make_kube_module "$work/kube" "$kube_version" "${missing[@]}"
  for c in "${missing[@]}"; do
    (cd "$work/kube" && CGO_ENABLED=0 go build -trimpath -ldflags "$(kube_ldflags "$kube_version")" -o "$out/$c.tmp" "k8s.io/kubernetes/cmd/$c")
    mv "$out/$c.tmp" "$out/$c"
  done
fi

if [[ ! -x $out/containerd || ! -x $out/containerd-shim-runc-v2 || ! -x $out/ctr ]]; then
  echo ">> building containerd v$containerd_version (about 2 minutes)"
  GOBIN="$work/containerd-bin" go install \
    "github.com/containerd/containerd/v2/cmd/containerd@v$containerd_version" \
    "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@v$containerd_version" \
    "github.com/containerd/containerd/v2/cmd/ctr@v$containerd_version"
  mv "$work/containerd-bin"/* "$out/"
fi
echo ">> kubelet, kube-controller-manager, kube-scheduler and containerd are in $out"
