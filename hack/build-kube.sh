#!/usr/bin/env bash
# Builds kube-apiserver and kubectl from k8s.io/kubernetes, and etcd from
# go.etcd.io/etcd/server/v3, through the Go module proxy (the only download
# that works on the machines this project is built on). The binaries land in
# $OUT (e.g. bin/k8s/1.37.2), which envtest uses as KUBEBUILDER_ASSETS.
#
# usage: hack/build-kube.sh KUBE_VERSION ETCD_VERSION OUT
set -euo pipefail

kube_version=${1:?kube version, e.g. 1.37.2}
etcd_version=${2:?etcd version, e.g. 3.6.6}
out=${3:?output folder}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# shellcheck source=hack/kube-module.sh
source "$(dirname "$0")/kube-module.sh"

if [[ ! -x $out/kube-apiserver || ! -x $out/kubectl ]]; then
  echo ">> building kube-apiserver and kubectl v$kube_version (about 5 minutes on 2 cores)"
  make_kube_module "$work/kube" "$kube_version" kube-apiserver kubectl
  cd "$work/kube"
  CGO_ENABLED=0 go build -trimpath -ldflags "$(kube_ldflags "$kube_version")" -o "$out/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver
  CGO_ENABLED=0 go build -trimpath -ldflags "$(kube_ldflags "$kube_version")" -o "$out/kubectl" k8s.io/kubernetes/cmd/kubectl
fi

if [[ ! -x $out/etcd ]]; then
  echo ">> building etcd v$etcd_version"
  mkdir -p "$work/etcd"
  cd "$work/etcd"
  go mod init local/etcd-build >/dev/null 2>&1
  go mod edit -require="go.etcd.io/etcd/server/v3@v$etcd_version"
  cat > tools.go <<'GO'
//go:build tools

package tools

import _ "go.etcd.io/etcd/server/v3"
GO
  go mod tidy >/dev/null
  CGO_ENABLED=0 go build -trimpath -o "$out/etcd" go.etcd.io/etcd/server/v3
fi
echo ">> kube-apiserver, kubectl and etcd are in $out"
