# Sourced by build-kube.sh and build-node.sh: make_kube_module DIR VERSION CMD...
# writes a throwaway module in DIR that requires k8s.io/kubernetes@vVERSION and
# imports the given commands. k8s.io/kubernetes replaces its staging modules
# with local paths; a module that depends on it must replace each with its
# published v0.Y.Z release. kube_ldflags prints the -ldflags that stamp the
# version into a binary (unstamped ones report v0.0.0-master, which the
# kubelet and the API server compare).

make_kube_module() {
  local dir=$1 version=$2
  shift 2
  mkdir -p "$dir"
  (
    cd "$dir"
    go mod init local/kube-build >/dev/null 2>&1
    go mod edit -require="k8s.io/kubernetes@v$version"
    local modfile staging_version m c
    modfile=$(go mod download -json "k8s.io/kubernetes@v$version" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
    staging_version="v0.${version#*.}"
    for m in $(sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\1#p' "$modfile"); do
      go mod edit -replace="$m=$m@$staging_version"
    done
    {
      printf '//go:build tools\n\npackage tools\n\nimport (\n'
      for c in "$@"; do printf '\t_ "k8s.io/kubernetes/cmd/%s"\n' "$c"; done
      printf ')\n'
    } > tools.go
    go mod tidy >/dev/null
  )
}

kube_ldflags() {
  local version=$1 minor
  minor=$(echo "$version" | cut -d. -f2)
  echo "-X k8s.io/component-base/version.gitVersion=v$version -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/client-go/pkg/version.gitVersion=v$version -X k8s.io/component-base/version.gitTreeState=clean"
}
