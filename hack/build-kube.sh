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

if [[ ! -x $out/kube-apiserver || ! -x $out/kubectl ]]; then
  echo ">> building kube-apiserver and kubectl v$kube_version (about 5 minutes on 2 cores)"
  mkdir -p "$work/kube"
  cd "$work/kube"
  go mod init local/kube-build >/dev/null 2>&1
  go mod edit -require="k8s.io/kubernetes@v$kube_version"
  # k8s.io/kubernetes replaces its staging modules with local paths; a module
  # that depends on it must replace each with its published v0.Y.Z release.
  modfile=$(go mod download -json "k8s.io/kubernetes@v$kube_version" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  staging_version="v0.${kube_version#*.}"
  for m in $(sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\1#p' "$modfile"); do
    go mod edit -replace="$m=$m@$staging_version"
  done
  cat > tools.go <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
GO
  go mod tidy >/dev/null
  CGO_ENABLED=0 go build -trimpath -o "$out/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver
  CGO_ENABLED=0 go build -trimpath -o "$out/kubectl" k8s.io/kubernetes/cmd/kubectl
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
