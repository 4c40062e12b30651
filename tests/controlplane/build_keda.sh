#!/usr/bin/env bash
# Builds KEDA's operator (./cmd/operator) and metrics API server (./cmd/adapter)
# from its Go module at the version pinned in keda.env, into a cache directory
# keyed by the hash of keda.env and this script, like build_kueue.sh, next to
# the module's own CRDs (config/crd/bases/*.yaml) that the test installs.
# KEDA's go.mod carries replace and exclude directives, which `go install
# pkg@version` refuses, so the build runs inside a writable copy of the
# downloaded module source. Optional: only tests/operator/test_keda.py needs
# it, and it skips without it. The last stdout line is the bin directory.
# With --cached it builds nothing: it prints the bin directory if the binaries
# are there and exits 3 otherwise (the test fixture's check; a build takes long).
#
# Env: DISTFLOW_CACHE (default ~/.cache/distflow), GO, BUILD_PARALLELISM (as build.sh).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=keda.env
source "${here}/keda.env"

GO="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"
jobs="${BUILD_PARALLELISM:-2}"
cache_root="${DISTFLOW_CACHE:-${HOME}/.cache/distflow}/keda"
key="$(cat "${here}/keda.env" "${here}/build_keda.sh" | sha256sum | cut -c1-16)"
bin="${cache_root}/${key}/bin"

if [[ -x "${bin}/keda-adapter" ]]; then echo "${bin}"; exit 0; fi
if [[ "${1:-}" == "--cached" ]]; then
  echo "build_keda.sh: KEDA ${KEDA_VERSION} not built (run: bash tests/controlplane/build_keda.sh)" >&2
  exit 3
fi
mkdir -p "${cache_root}"
exec 9>"${cache_root}/${key}.lock"
flock 9
if [[ -x "${bin}/keda-adapter" ]]; then echo "${bin}"; exit 0; fi

export CGO_ENABLED=0
export GOFLAGS="-mod=readonly -buildvcs=false"
module="github.com/kedacore/keda/v2"
mod_dir="$(cd /tmp && "${GO}" mod download -json "${module}@${KEDA_VERSION}" |
  sed -n 's/^\s*"Dir": "\(.*\)",\?$/\1/p')"
[[ -d "${mod_dir}" ]] || { echo "build_keda.sh: cannot download ${module}@${KEDA_VERSION}" >&2; exit 1; }
src="${cache_root}/${key}/src"
rm -rf "${src}" && mkdir -p "$(dirname "${src}")" "${bin}"
cp -r "${mod_dir}" "${src}" && chmod -R u+w "${src}"

echo "[build_keda.sh $(date +%H:%M:%S)] building keda ${KEDA_VERSION}" >&2
start=${SECONDS}
ldflags="-s -w -X=${module}/version.Version=${KEDA_VERSION} -X=${module}/version.GitCommit=${KEDA_VERSION}"
(cd "${src}" &&
  "${GO}" build -p "${jobs}" -trimpath -ldflags="${ldflags}" -o "${bin}/keda-operator.tmp" ./cmd/operator &&
  "${GO}" build -p "${jobs}" -trimpath -ldflags="${ldflags}" -o "${bin}/keda-adapter.tmp" ./cmd/adapter)
config="${cache_root}/${key}/config"
rm -rf "${config}" && mkdir -p "${config}/crd"
cp "${src}"/config/crd/bases/*.yaml "${config}/crd/"
mv "${bin}/keda-operator.tmp" "${bin}/keda-operator"
mv "${bin}/keda-adapter.tmp" "${bin}/keda-adapter"
rm -rf "${src}"
echo "[build_keda.sh $(date +%H:%M:%S)] built keda in $((SECONDS - start)) s" >&2
echo "${bin}"
