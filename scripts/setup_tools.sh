#!/usr/bin/env bash
# Install the system tools the test suite needs, when we may (root and apt-get).
#
#   scripts/setup_tools.sh           install what is missing, or fail at once saying how
#   scripts/setup_tools.sh --check   only say whether it is all there or can be installed
#
# The tools, and who needs them:
#   nft (nftables)                    the namespace testbed's link cut, tests/integration/test_testbed.py
#   ip, tc (iproute2)                 the namespace testbed's namespaces and shaped links
#   dockerd, docker (docker.io)       the compose testbed, tests/integration/test_compose.py
#   docker-compose (docker-compose)   the same
#   debootstrap                       the compose testbed's base image where no registry answers
#   tmux                              the live views in a real terminal, tests/integration/test_terminal.py
#   stress-ng                         scripts/stress_tests.sh
# Exits 0 when every tool is there (or was installed), 1 with the one command to run otherwise.
# scripts/test.sh runs it beside scripts/setup.sh: apt's downloads and pip's at the same time.
set -euo pipefail
PATH="$PATH:/usr/sbin:/sbin"  # nft, ip and tc live there, off a user's PATH on Debian

# command -> the Debian package that brings it
TOOLS=(
    nft:nftables
    ip:iproute2
    tc:iproute2
    dockerd:docker.io
    docker:docker.io
    docker-compose:docker-compose
    debootstrap:debootstrap
    tmux:tmux
    stress-ng:stress-ng
)

say() { echo "setup_tools: $*" >&2; }

packages=()
for entry in "${TOOLS[@]}"; do
    tool=${entry%%:*} package=${entry#*:}
    # Compose may come as Docker's own plugin ('docker compose') instead of Debian's docker-compose.
    if [ "$tool" = docker-compose ] && docker compose version >/dev/null 2>&1; then
        continue
    fi
    if ! command -v "$tool" >/dev/null 2>&1 && [[ " ${packages[*]} " != *" $package "* ]]; then
        packages+=("$package")
    fi
done

if [ ${#packages[@]} -eq 0 ]; then
    [ "${1:-}" = --check ] || say "ok (nft, ip, tc, docker, docker-compose, debootstrap, tmux, stress-ng)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    say "the tests need these Debian packages, and there is no apt-get here: ${packages[*]}"
    say "install their equivalents with your package manager (Docker: https://docs.docker.com/engine/install/), then run this again"
    exit 1
fi
if [ "$(id -u)" != 0 ]; then
    say "the tests need system tools that are missing; install them, then run this again:"
    echo "    sudo apt-get install -y ${packages[*]}" >&2
    exit 1
fi
[ "${1:-}" = --check ] && exit 0

say "installing ${packages[*]} (apt-get)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null
for entry in "${TOOLS[@]}"; do
    tool=${entry%%:*}
    if [ "$tool" = docker-compose ] && docker compose version >/dev/null 2>&1; then
        continue
    fi
    command -v "$tool" >/dev/null 2>&1 || { say "apt-get installed ${packages[*]}, but $tool is still missing"; exit 1; }
done
say "ok (installed ${packages[*]})"
