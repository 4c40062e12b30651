#!/usr/bin/env bash
# Builds Kueue's controller manager (sigs.k8s.io/kueue/cmd/kueue) from its Go
# module at the version pinned in kueue.env, into a cache directory keyed by
# the hash of kueue.env and this script, like build.sh, next to the module's
# own CRDs (config/crd/*.yaml) and webhook configurations
# (config/webhook.yaml) that the test fixture installs. Optional: only the
# Kueue tests need it, and they skip without it. The last stdout line is the
# path of the binary.
#
# Env: DISTFLOW_CACHE (default ~/.cache/distflow), GO, BUILD_PARALLELISM (as build.sh).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=kueue.env
source "${here}/kueue.env"

GO="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"
jobs="${BUILD_PARALLELISM:-2}"
cache_root="${DISTFLOW_CACHE:-${HOME}/.cache/distflow}/kueue"
key="$(cat "${here}/kueue.env" "${here}/build_kueue.sh" | sha256sum | cut -c1-16)"
out="${cache_root}/${key}/bin/kueue"

if [[ -x "${out}" ]]; then echo "${out}"; exit 0; fi
mkdir -p "${cache_root}"
exec 9>"${cache_root}/${key}.lock"
flock 9
if [[ -x "${out}" ]]; then echo "${out}"; exit 0; fi

export CGO_ENABLED=0
export GOFLAGS="-mod=mod -buildvcs=false"
dir="${cache_root}/${key}/src"
rm -rf "${dir}" && mkdir -p "${dir}" "$(dirname "${out}")"
printf 'module distflow.test/kueue\n\ngo 1.26.0\n\nrequire sigs.k8s.io/kueue %s\n' \
  "${KUEUE_VERSION}" >"${dir}/go.mod"
echo "[build_kueue.sh $(date +%H:%M:%S)] building kueue ${KUEUE_VERSION}" >&2
start=${SECONDS}
(cd "${dir}" && "${GO}" build -p "${jobs}" -trimpath \
  -ldflags="-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=${KUEUE_VERSION}" \
  -o "${out}.tmp" sigs.k8s.io/kueue/cmd/kueue)
mod_dir="$(cd "${dir}" && "${GO}" mod download -json "sigs.k8s.io/kueue@${KUEUE_VERSION}" |
  sed -n 's/^\s*"Dir": "\(.*\)",\?$/\1/p')"
config="${cache_root}/${key}/config"
rm -rf "${config}" && mkdir -p "${config}/crd"
cp "${mod_dir}"/config/components/crd/bases/*.yaml "${config}/crd/"
cp "${mod_dir}/config/components/webhook/manifests.yaml" "${config}/webhook.yaml"
mv "${out}.tmp" "${out}"
echo "[build_kueue.sh $(date +%H:%M:%S)] built kueue in $((SECONDS - start)) s" >&2
echo "${out}"
