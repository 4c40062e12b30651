#!/usr/bin/env bash
# Builds the test control plane (kube-apiserver, kube-controller-manager,
# kube-scheduler, etcd, kwok, helm) from Go modules at the versions pinned in
# versions.env, into a cache directory keyed by the hash of versions.env and
# this script. A warm run builds nothing. The last stdout line is the bin dir.
#
# Env: DISTFLOW_CACHE (default ~/.cache/distflow), GO (default: go on PATH,
# else /usr/local/go/bin/go), BUILD_PARALLELISM (go build -p, default 2).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "${here}/versions.env"

GO="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"
jobs="${BUILD_PARALLELISM:-2}"
cache_root="${DISTFLOW_CACHE:-${HOME}/.cache/distflow}/controlplane"
key="$(cat "${here}/versions.env" "${here}/build.sh" | sha256sum | cut -c1-16)"
bin_dir="${cache_root}/${key}/bin"
work_dir="${cache_root}/${key}/src"
binaries=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok helm)

have_all() {
  local b
  for b in "${binaries[@]}"; do [[ -x "${bin_dir}/${b}" ]] || return 1; done
}

if have_all; then
  echo "${bin_dir}"
  exit 0
fi

mkdir -p "${cache_root}"
# One build at a time per cache key: a second caller waits, then finds the binaries.
exec 9>"${cache_root}/${key}.lock"
flock 9
if have_all; then
  echo "${bin_dir}"
  exit 0
fi

export CGO_ENABLED=0
# -mod=mod lets the generated modules resolve their requirements from go.mod.
export GOFLAGS="-mod=mod -buildvcs=false"
mkdir -p "${bin_dir}" "${work_dir}"

log() { echo "[build.sh $(date +%H:%M:%S)] $*" >&2; }

# new_module DIR REQUIRE_PATH VERSION: a throwaway module that requires one module.
new_module() {
  local dir="$1" path="$2" version="$3"
  rm -rf "${dir}" && mkdir -p "${dir}"
  printf 'module distflow.test/%s\n\ngo 1.26.0\n\nrequire %s %s\n' \
    "$(basename "${dir}")" "${path}" "${version}" >"${dir}/go.mod"
}

# build_one DIR PACKAGE OUTPUT [LDFLAGS]: builds one binary unless present.
build_one() {
  local dir="$1" pkg="$2" out="$3" ldflags="${4:-}"
  if [[ -x "${bin_dir}/${out}" ]]; then return 0; fi
  log "building ${out} from ${pkg}"
  local start=${SECONDS}
  (cd "${dir}" && "${GO}" build -p "${jobs}" -trimpath \
    -ldflags="-s -w ${ldflags}" -o "${bin_dir}/${out}.tmp" "${pkg}")
  mv "${bin_dir}/${out}.tmp" "${bin_dir}/${out}"
  log "built ${out} in $((SECONDS - start)) s"
}

# k8s.io/kubernetes replaces its ~30 staging modules with local directories,
# which a dependent module cannot see; point each at its published v0 twin.
build_kubernetes() {
  local dir="${work_dir}/kubernetes" minor_patch="${KUBERNETES_VERSION#v1.}"
  new_module "${dir}" k8s.io/kubernetes "${KUBERNETES_VERSION}"
  local k8s_mod
  k8s_mod="$(cd "${dir}" && "${GO}" mod download -json "k8s.io/kubernetes@${KUBERNETES_VERSION}" |
    sed -n 's/^\s*"GoMod": "\(.*\)",\?$/\1/p')"
  [[ -f "${k8s_mod}" ]] || { log "no go.mod for k8s.io/kubernetes@${KUBERNETES_VERSION}"; exit 1; }
  {
    echo
    echo 'replace ('
    sed -n 's#^\s*\(k8s\.io/[A-Za-z0-9_.-]*\) => \./staging/src/.*$#\t\1 => \1 v0.'"${minor_patch}"'#p' "${k8s_mod}"
    echo ')'
  } >>"${dir}/go.mod"
  local v="k8s.io/component-base/version" c="k8s.io/client-go/pkg/version"
  local major="${KUBERNETES_VERSION#v}" minor
  minor="${major#*.}" && minor="${minor%%.*}" && major="${major%%.*}"
  local ld="" p
  for p in "${v}" "${c}"; do
    ld+=" -X ${p}.gitVersion=${KUBERNETES_VERSION} -X ${p}.gitMajor=${major}"
    ld+=" -X ${p}.gitMinor=${minor} -X ${p}.gitTreeState=clean"
  done
  local cmd
  for cmd in kube-apiserver kube-controller-manager kube-scheduler; do
    build_one "${dir}" "k8s.io/kubernetes/cmd/${cmd}" "${cmd}" "${ld}"
  done
}

build_etcd() {
  local dir="${work_dir}/etcd"
  new_module "${dir}" go.etcd.io/etcd/server/v3 "${ETCD_VERSION}"
  build_one "${dir}" go.etcd.io/etcd/server/v3 etcd
}

build_kwok() {
  local dir="${work_dir}/kwok"
  new_module "${dir}" sigs.k8s.io/kwok "${KWOK_VERSION}"
  build_one "${dir}" sigs.k8s.io/kwok/cmd/kwok kwok
}

build_helm() {
  local dir="${work_dir}/helm"
  new_module "${dir}" helm.sh/helm/v3 "${HELM_VERSION}"
  build_one "${dir}" helm.sh/helm/v3/cmd/helm helm \
    "-X helm.sh/helm/v3/internal/version.version=${HELM_VERSION}"
}

[[ -x "${bin_dir}/etcd" ]] || build_etcd
[[ -x "${bin_dir}/kube-apiserver" && -x "${bin_dir}/kube-controller-manager" && \
   -x "${bin_dir}/kube-scheduler" ]] || build_kubernetes
[[ -x "${bin_dir}/kwok" ]] || build_kwok
[[ -x "${bin_dir}/helm" ]] || build_helm

have_all || { log "missing binaries in ${bin_dir}"; exit 1; }
echo "${bin_dir}"
