#!/bin/sh
# Entry point of a compose testbed container: shape this container's link if asked, then run noloco.
#
#   NOLOCO_EGRESS_RATE     tc rate of everything this container sends (e.g. 8mbit); unset: unshaped.
#                          A token bucket (tbf) on the interface's root: needs cap_add NET_ADMIN.
#   NOLOCO_SHAPE_DEV       the interface to shape (default eth0)
#   NOLOCO_BOOTSTRAP_FILE  for `join`: wait for this file and pass its content as --initial-peers
#
# Only egress is shaped: this kernel (and many) lacks the police action and ifb that ingress
# shaping needs, and a slow uplink is what a volunteer on a home line has anyway.
set -eu

if [ -n "${NOLOCO_EGRESS_RATE:-}" ]; then
    dev="${NOLOCO_SHAPE_DEV:-eth0}"
    # burst: at least rate/HZ; 64 kB covers up to ~50 mbit at HZ=100. latency bounds the queue.
    if ! tc qdisc replace dev "$dev" root tbf rate "$NOLOCO_EGRESS_RATE" burst 64kb latency 400ms; then
        echo "noloco-peer: cannot shape $dev (the container needs cap_add: [NET_ADMIN])" >&2
        exit 2
    fi
    echo "noloco-peer: $dev egress shaped to $NOLOCO_EGRESS_RATE" >&2
fi

if [ "${1:-}" = join ] && [ -n "${NOLOCO_BOOTSTRAP_FILE:-}" ]; then
    waited=0
    while [ ! -s "$NOLOCO_BOOTSTRAP_FILE" ]; do
        if [ "$waited" -ge 120 ]; then
            echo "noloco-peer: no bootstrap address in $NOLOCO_BOOTSTRAP_FILE after 60 s" >&2
            exit 2
        fi
        sleep 0.5
        waited=$((waited + 1))
    done
    shift
    set -- join --initial-peers "$(cat "$NOLOCO_BOOTSTRAP_FILE")" "$@"
fi
exec noloco "$@"
