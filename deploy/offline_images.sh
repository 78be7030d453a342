#!/usr/bin/env bash
# pdserve's CPU image and a Redis image with no registry at all, from Debian's packages and PyPI:
#
#   1. one base image, a Debian root filesystem (mmdebstrap) made an image (docker import), with
#      python3, pip and gcc for pdserve and Debian's redis-server for the Redis container (one
#      debootstrap instead of two: the slowest step of a cold run);
#   2. a wheelhouse on this host (pip download: the project's dependencies, torch's CPU build);
#   3. pdserve's image: the Dockerfile on the python base, PYTHON_IMAGE=<base> WHEELHOUSE=1, its
#      build context the working tree (as .dockerignore filters it) plus the wheels.
#
# Each image is tagged with a hash of its inputs and built only when that tag is missing, so a
# second run on the same machine builds nothing; older tags of the same images are removed.
# Prints the tags for compose.yaml, one `NAME=value` a line:
#
#   PDSERVE_IMAGE=pdserve-offline:...  PDSERVE_REDIS_IMAGE=pdserve-debian:...
#   PDSERVE_PYTHON_IMAGE=pdserve-debian:...
#
# Needs root (mmdebstrap), a Docker engine, apt reaching a Debian mirror and pip reaching PyPI.
# pip must find torch's CPU build: here a local file (pip config's find-links); elsewhere set
# PDSERVE_TORCH_INDEX=https://download.pytorch.org/whl/cpu. A CUDA torch is refused.
set -euo pipefail
shopt -s inherit_errexit  # a failure inside $(...) stops the script too
REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${PDSERVE_COMPOSE_CACHE:-/var/cache/pdserve-compose}
SUITE=${PDSERVE_DEBIAN_SUITE:-bookworm}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
# What the base holds; part of its tag, so a change here builds a new one.
BASE_PACKAGES=python3,python3-pip,python-is-python3,gcc,libc6-dev,ca-certificates,redis-server
# The images' Python (bookworm's 3.11, glibc 2.36) decides which wheels fit, not the host's;
# pip takes each manylinux tag it may use literally.
WHEEL_TARGET=(--python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none
  --only-binary=:all: --platform manylinux1_x86_64 --platform manylinux2010_x86_64
  --platform manylinux2014_x86_64)
for glibc_minor in $(seq 5 36); do
  WHEEL_TARGET+=(--platform "manylinux_2_${glibc_minor}_x86_64")
done

log() { echo "[offline-images] $*" >&2; }
short_hash() { sha256sum | cut -c1-16; }

# Removes the other tags of `repo` than `keep` (a previous run's images).
drop_older() {
  local repo=$1 keep=$2 tag
  for tag in $(docker image ls --format '{{.Repository}}:{{.Tag}}' "$repo"); do
    if [ "$tag" != "$keep" ]; then docker image rm "$tag" >/dev/null || true; fi
  done
}

# debian_image NAME PACKAGES: a minimal Debian root with PACKAGES, imported as NAME:<hash>.
# EXTERNALLY-MANAGED goes, so `pip install` works system-wide as in python:3.11-slim.
debian_image() {
  local name=$1 packages=$2 tag
  # shellcheck disable=SC2016 # "$1" is the new root, expanded by mmdebstrap's hook shell
  local options=(--variant=minbase --include="$packages"
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*'
    --dpkgopt='path-exclude=/usr/share/locale/*'
    --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED')
  tag="$name:$(printf '%s\n' "$SUITE" "${options[@]}" | short_hash)"
  if ! docker image inspect "$tag" >/dev/null 2>&1; then
    log "building $tag: Debian $SUITE with $packages (mmdebstrap)"
    mmdebstrap --quiet "${options[@]}" "$SUITE" - |
      docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' - "$tag" >/dev/null
    drop_older "$name" "$tag"
  fi
  echo "$tag"
}

# The project's runtime dependencies, as pyproject.toml lists them.
dependencies() {
  "$PYTHON" -c 'import sys, tomllib; print(*tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"], sep="\n")' \
    "$REPO/pyproject.toml"
}

# A folder of wheels for the image, made once per dependency list; torch's CPU build or nothing.
wheelhouse() {
  local key dir index=()
  key=$( (dependencies; echo "$TORCH_VERSION") | short_hash)
  dir=$CACHE/wheelhouse-$key
  if [ -e "$dir/.complete" ]; then echo "$dir"; return; fi
  if [ -n "${PDSERVE_TORCH_INDEX:-}" ]; then index=(--extra-index-url "$PDSERVE_TORCH_INDEX"); fi
  log "wheelhouse $dir: pip download (torch $TORCH_VERSION CPU, pyproject's dependencies)"
  rm -rf "$dir" && mkdir -p "$dir"
  "$PYTHON" -m pip download --quiet --no-deps "${WHEEL_TARGET[@]}" "${index[@]}" --dest "$dir" \
    "torch==$TORCH_VERSION"
  if ! ls "$dir"/torch-*+cpu-*.whl >/dev/null 2>&1; then
    log "pip found no CPU build of torch $TORCH_VERSION ($(ls "$dir")): a CUDA torch never goes"
    log "in the CPU image. Point pip at it: PDSERVE_TORCH_INDEX=https://download.pytorch.org/whl/cpu"
    exit 1
  fi
  mapfile -t deps < <(dependencies)
  # pip evaluates markers for the host's interpreter: the image's 3.11.2 also needs what
  # redis-py asks for below 3.11.3.
  "$PYTHON" -m pip download --quiet "${WHEEL_TARGET[@]}" "${index[@]}" --dest "$dir" \
    "torch==$TORCH_VERSION" "${deps[@]}" 'setuptools>=68' wheel 'async-timeout>=4.0.3'
  find "$CACHE" -maxdepth 1 -name 'wheelhouse-*' ! -path "$dir" -exec rm -rf {} +
  touch "$dir/.complete"
  echo "$dir"
}

# The build context: what git sees in the working tree (tracked and new files, not ignored ones),
# less tests/ docs/ deploy/, and the wheels in deploy/wheelhouse/ (hard links, no copy).
stage_context() {
  local ctx=$1 wheels=$2
  rm -rf "$ctx" && mkdir -p "$ctx/deploy/wheelhouse"
  (cd "$REPO" && git ls-files -z --cached --others --exclude-standard |
    grep -zvE '^(tests|docs|deploy)/' | tar --null --ignore-failed-read -T - -cf - 2>/dev/null) |
    tar -C "$ctx" -xf -
  ln "$wheels"/*.whl "$ctx/deploy/wheelhouse/" 2>/dev/null || cp "$wheels"/*.whl "$ctx/deploy/wheelhouse/"
}

# pdserve_image PYTHON_BASE WHEELHOUSE: pdserve-offline:<hash of context, base, wheels>.
pdserve_image() {
  local base=$1 wheels=$2 ctx=$CACHE/context tag
  stage_context "$ctx" "$wheels"
  tag="pdserve-offline:$( (cd "$ctx" && find . -path ./deploy -prune -o -type f -print0 |
    LC_ALL=C sort -z | xargs -0 sha256sum; echo "$base $wheels") | short_hash)"
  if ! docker image inspect "$tag" >/dev/null 2>&1; then
    log "building $tag on $base (offline: pip --no-index from the wheelhouse)"
    docker build --quiet --force-rm --network none --tag "$tag" --build-arg PYTHON_IMAGE="$base" \
      --build-arg WHEELHOUSE=1 --build-arg TORCH_VARIANT=cpu "$ctx" >/dev/null
    drop_older pdserve-offline "$tag"
  fi
  rm -rf "$ctx"
  echo "$tag"
}

main() {
  mkdir -p "$CACHE"
  local base wheels pdserve
  base=$(debian_image pdserve-debian "$BASE_PACKAGES")
  log "base $base after ${SECONDS} s"
  wheels=$(wheelhouse)
  log "wheelhouse after ${SECONDS} s"
  pdserve=$(pdserve_image "$base" "$wheels")
  log "pdserve image after ${SECONDS} s"
  printf 'PDSERVE_IMAGE=%s\nPDSERVE_REDIS_IMAGE=%s\nPDSERVE_PYTHON_IMAGE=%s\n' \
    "$pdserve" "$base" "$base"
}

main "$@"
