#!/usr/bin/env bash
# Fetches KubeRay's CRDs (ray.io: RayCluster, RayJob, RayService) from the
# ray-operator Go module at the version pinned in kuberay.env, into a cache
# directory keyed by the hash of kuberay.env and this script, like
# build_kueue.sh. Nothing is compiled: the module's config/crd/bases holds the
# CRDs KubeRay's Helm chart installs. Optional: only the RayJob example's test
# needs them, and it skips without them. The last stdout line is the directory
# holding the CRD files.
#
# Env: DISTFLOW_CACHE (default ~/.cache/distflow), GO.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=kuberay.env
source "${here}/kuberay.env"

GO="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"
cache_root="${DISTFLOW_CACHE:-${HOME}/.cache/distflow}/kuberay"
key="$(cat "${here}/kuberay.env" "${here}/fetch_kuberay_crds.sh" | sha256sum | cut -c1-16)"
out="${cache_root}/${key}/crd"

if [[ -f "${out}/.complete" ]]; then echo "${out}"; exit 0; fi
mkdir -p "${cache_root}"
exec 9>"${cache_root}/${key}.lock"
flock 9
if [[ -f "${out}/.complete" ]]; then echo "${out}"; exit 0; fi

module="github.com/ray-project/kuberay/ray-operator"
work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT
printf 'module distflow.test/kuberay\n\ngo 1.26.0\n' >"${work}/go.mod"
echo "[fetch_kuberay_crds.sh $(date +%H:%M:%S)] fetching ${module}@${KUBERAY_VERSION}" >&2
mod_dir="$(cd "${work}" && GOFLAGS=-mod=mod "${GO}" mod download -json "${module}@${KUBERAY_VERSION}" |
  sed -n 's/^\s*"Dir": "\(.*\)",\?$/\1/p')"
[[ -n "${mod_dir}" && -d "${mod_dir}/config/crd/bases" ]] \
  || { echo "fetch_kuberay_crds.sh: ${module}@${KUBERAY_VERSION} has no config/crd/bases" >&2; exit 1; }
rm -rf "${out}" && mkdir -p "${out}"
cp "${mod_dir}"/config/crd/bases/ray.io_*.yaml "${out}/"
chmod u+w "${out}"/*.yaml
touch "${out}/.complete"
echo "${out}"
