#!/usr/bin/env bash
# One command for the docker-compose testbed: get the engine and images ready, run bootstrap + 2x2
# peers in containers, show them with `noloco status`, check the result, and always tear down.
#
#   scripts/compose_testbed.sh [--steps N] [--slow stage1-b=4mbit] [--out DIR] ...
#
# Options go to noloco_swarm/harness/compose.py (--help lists them). It exits 0 when the run passed,
# 1 when a check failed, 2 on a hang, 3 when something it needs is missing (it says what to do).
# Environment: NOLOCO_COMPOSE_CACHE (a folder that keeps the images between engines, as on CI),
# NOLOCO_BASE_IMAGE (default python:3.11-slim; when it cannot be pulled, a Debian 12
# image is built here with debootstrap), NOLOCO_IMAGE (default noloco-swarm:latest), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
PROJECT=noloco-testbed
IMAGE="${NOLOCO_IMAGE:-noloco-swarm:latest}"
BASE="${NOLOCO_BASE_IMAGE:-python:3.11-slim}"
LOCAL_BASE=noloco-swarm-base:bookworm
TORCH_VERSION="${NOLOCO_TORCH_VERSION:-2.13.0}"
STARTED_DOCKERD=""
COMPOSE=()

for arg in "$@"; do  # help needs no engine
    case "$arg" in -h | --help) exec "${PYTHON:-python3}" -m noloco_swarm.harness.compose --help ;; esac
done

say() { echo "compose_testbed: $*" >&2; }
missing() { say "$*"; exit 3; }

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [ ${#COMPOSE[@]} -gt 0 ] && docker info >/dev/null 2>&1; then
        "${COMPOSE[@]}" -p "$PROJECT" down --volumes --remove-orphans --timeout 10 >/dev/null 2>&1 || true
    fi
    if [ -n "$STARTED_DOCKERD" ]; then
        # we started the engine: stop it, and give back the host's forwarding policy and bridge
        # netfilter setting, which dockerd changes (they break bridged network namespaces)
        say "stopping the dockerd this script started (pid $STARTED_DOCKERD)"
        kill "$STARTED_DOCKERD" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 "$STARTED_DOCKERD" 2>/dev/null || break; sleep 0.5; done
        iptables -P FORWARD "$FORWARD_POLICY" 2>/dev/null || true
        [ -w /proc/sys/net/bridge/bridge-nf-call-iptables ] && echo "$BRIDGE_NF" >/proc/sys/net/bridge/bridge-nf-call-iptables
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- an engine -------------------------------------------------------------------------------
command -v docker >/dev/null || missing "no Docker engine. Debian/Ubuntu: sudo apt-get install docker.io docker-compose;
  elsewhere: https://docs.docker.com/engine/install/ (it brings the 'docker compose' plugin)"
if ! docker info >/dev/null 2>&1; then
    if command -v dockerd >/dev/null && [ "$(id -u)" = 0 ]; then
        FORWARD_POLICY=$(iptables -S FORWARD 2>/dev/null | awk '/^-P FORWARD/ {print $3}')
        FORWARD_POLICY=${FORWARD_POLICY:-ACCEPT}
        BRIDGE_NF=$(cat /proc/sys/net/bridge/bridge-nf-call-iptables 2>/dev/null || echo 0)
        mkdir -p runs
        say "the Docker engine is installed but not running: starting dockerd (log: runs/dockerd.log)"
        # its own session: a Ctrl-C at the terminal must reach the run, not the engine under it
        setsid nice -n 10 dockerd >runs/dockerd.log 2>&1 &
        STARTED_DOCKERD=$!
        for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
        docker info >/dev/null 2>&1 || missing "dockerd did not come up; see runs/dockerd.log"
    else
        missing "the Docker engine is not running or not yours: sudo systemctl start docker (or sudo dockerd &),
  and run this as root or as a member of the docker group (sudo usermod -aG docker \$USER)"
    fi
fi
if docker compose version >/dev/null 2>&1; then
    COMPOSE=(docker compose)
elif command -v docker-compose >/dev/null; then
    COMPOSE=(docker-compose)
else
    missing "no Docker Compose. Debian/Ubuntu: sudo apt-get install docker-compose (or docker-compose-plugin
  from Docker's repository); elsewhere: https://docs.docker.com/compose/install/"
fi

# --- Python for the judging helper (stdlib and this checkout only) ----------------------------
PY="${PYTHON:-}"
[ -z "$PY" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
PY="${PY:-python3}"
"$PY" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null || missing "needs Python 3.11+ as \$PYTHON or python3"

# --- cached images: NOLOCO_COMPOSE_CACHE=DIR keeps them (docker save) for an engine that starts
# empty, as on CI; keyed by what the base and dependency layers are built from. Loaded first, so
# the local base keeps its id and the build reuses the loaded layers (--cache-from).
CACHE_TAR=""
if [ -n "${NOLOCO_COMPOSE_CACHE:-}" ]; then
    key=$(cat Dockerfile constraints.txt pyproject.toml <(echo "$BASE $TORCH_VERSION") | sha256sum | cut -c1-16)
    CACHE_TAR="$NOLOCO_COMPOSE_CACHE/images-$key.tar"
    if [ -s "$CACHE_TAR" ] && ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
        say "loading cached images from $CACHE_TAR"
        docker load -q -i "$CACHE_TAR" >/dev/null || rm -f "$CACHE_TAR"
    fi
fi

# --- the base image: the official one, else a Debian 12 built here ---------------------------
if ! docker image inspect "$BASE" >/dev/null 2>&1 && ! docker pull -q "$BASE" >/dev/null 2>&1; then
    say "cannot pull $BASE (no registry?): using a local Debian 12 base, $LOCAL_BASE"
    if ! docker image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
        command -v debootstrap >/dev/null && [ "$(id -u)" = 0 ] || missing "building $LOCAL_BASE needs root
  and debootstrap (sudo apt-get install debootstrap), or give an image that has Python 3.11 as NOLOCO_BASE_IMAGE"
        root=$(mktemp -d)
        mkdir -p runs
        say "debootstrap bookworm into $root (about a minute)"
        nice -n 10 debootstrap --variant=minbase --include=python3,python3-venv,iproute2,ca-certificates \
            bookworm "$root" "${NOLOCO_DEBIAN_MIRROR:-http://deb.debian.org/debian}" >runs/debootstrap.log 2>&1 ||
            { rm -rf "$root"; missing "debootstrap failed; see runs/debootstrap.log"; }
        tar -C "$root" -c . | docker import - "$LOCAL_BASE" >/dev/null
        rm -rf "$root"
    fi
    BASE=$LOCAL_BASE
fi

# --- the wheelhouse: this machine's torch CPU wheel and CA bundle, when it has them -----------
if ! ls docker/wheelhouse/torch-"$TORCH_VERSION"*.whl >/dev/null 2>&1; then
    "$PY" -m pip download -q --no-deps --no-index "torch==$TORCH_VERSION+cpu" -d docker/wheelhouse 2>/dev/null &&
        say "using this machine's torch $TORCH_VERSION CPU wheel (docker/wheelhouse/)" || true
fi
if [ -s /etc/ssl/certs/ca-certificates.crt ] && ! cmp -s /etc/ssl/certs/ca-certificates.crt docker/wheelhouse/ca-certificates.crt; then
    cp /etc/ssl/certs/ca-certificates.crt docker/wheelhouse/ca-certificates.crt
fi

# --- the image (host networking: pip reaches the index where the bridge has no route out) ---
say "building $IMAGE on $BASE"
start=$SECONDS
docker build --force-rm --network host --build-arg BASE_IMAGE="$BASE" --cache-from "$IMAGE" -t "$IMAGE" -q . >/dev/null ||
    { say "the image build failed: run 'docker build --network host --build-arg BASE_IMAGE=$BASE .' to see why"; exit 1; }
say "image ready in $((SECONDS - start)) s"
if [ -n "$CACHE_TAR" ] && [ ! -s "$CACHE_TAR" ]; then
    mkdir -p "$NOLOCO_COMPOSE_CACHE"
    rm -f "$NOLOCO_COMPOSE_CACHE"/images-*.tar
    images=("$IMAGE")
    [ "$BASE" = "$LOCAL_BASE" ] && images+=("$LOCAL_BASE")  # a pulled base comes back by pull
    docker save -o "$CACHE_TAR.tmp" "${images[@]}" && mv "$CACHE_TAR.tmp" "$CACHE_TAR" && say "images cached in $CACHE_TAR"
fi

# --- run, check, tear down (the helper takes the project down itself; the trap is the backstop)
"$PY" -m noloco_swarm.harness.compose --compose "${COMPOSE[*]}" --image "$IMAGE" --project "$PROJECT" \
    --command "scripts/compose_testbed.sh $*" "$@"
