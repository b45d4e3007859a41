"""How the membership scales: the membership simulator (noloco_swarm/sim/membership.py) at N = 8
to 1,000 peers, under three DHTs, with churn.

Every view is built by protocol.membership's own rules; the simulator models what peers read and
when. Record sizes are measured here from real signed records (an announcement with two
addresses, a gone report), not assumed. DHTs:

  fast        a store is readable after a lognormal delay, median 0.3 s, sigma 1
  slow        median 2 s, sigma 1.5; 10% of (record, reader) pairs two rounds late; 5% of stores
              lost; 5% of boundary reads fail
  partition   fast, and a quarter of the peers cut off from the rest for 90 s in round 4

Churn, per peer and hour: 0.1 crashes, 0.1 graceful leaves, 0.1 stalls of 90 s, 0.3 newcomers;
10% of peers reach each boundary up to 10 s late. Rounds of 60 s (H = 50, B = 8), 4 stages.

The defaults are the peer as it runs (since 2026-12-07): records passed between members
(--records gossip), heartbeats under a key per bucket of 16 members and reports under a key per
accused (--directory spread), no audits (--audits 0), and since 2026-12-07 a joiner that asks
members whom to join with (--join member; before, --join whole: it read every bucket), and since
2026-12-07 only a peer's monitors report it gone (--reporters monitors; before, --reporters all:
every member that found it). The partition runs only up to N = 256 by default (--partition-max):
with every finder reporting, its gone reports grow as N^2 (each side reports the peers of the
other it routes rows to), and at N = 1,000 the run did not finish in 40 minutes of one core; with
monitors it takes about 2.5 minutes. Rows with "real": true already in --out (bench/big_swarm.py's)
are kept.

    python bench/membership_scale.py --partition-max 1000 --out docs/results/membership_scale.json

Monitors against every finder reporting (the peer before 2026-12-07; the partition up to N = 256):

    python bench/membership_scale.py --peers 32,128,256,1000 --rounds 32:60,128:30,256:16,1000:8 \
        --dhts fast,slow,partition --reporters all,monitors --out docs/results/membership_monitors.json

A joiner that asks members (--join member, the peer since 2026-12-07; issue 36, item 4) against
one that reads every bucket (the peer before), fast DHT:

    python bench/membership_scale.py --peers 8,32,128,256,1000 --rounds 8:60,32:60,128:30,256:16,1000:8 \
        --dhts fast --join whole,member --out docs/results/membership_join.json

The designs before, each run by the simulator of their date (the commands below give other
figures since 2026-12-07 unless run at the commit their results name: only monitors report,
which --reporters all undoes, and the simulator passes a report on at once, as the peer does).
The rules since 2026-12-06
with the DHT alone (every member reads the whole directory at every boundary):

    python bench/membership_scale.py --records dht --directory whole --audits 2 \
        --partition-max 1000 --out docs/results/membership_dht_only.json

The flat-load comparison (at b09a0dc, when "spread" meant a key per peer):

    python bench/membership_scale.py --peers 8,32,128,256,1000 \
        --rounds 8:60,32:60,128:30,256:16,1000:8 --records gossip --directory spread --audits 2 \
        --partition-max 1000 --out docs/results/membership_flat.json

The peer's directory as it stores since 4d48904 (joiners' whole reads counted):

    python bench/membership_scale.py --peers 8,32,128,256,1000 \
        --rounds 8:60,32:60,128:30,256:16,1000:8 --dhts fast,slow \
        --out docs/results/membership_buckets.json

and before it (at 8fef12b, when heartbeats were modelled under a key per peer):

    python bench/membership_scale.py --peers 8,32,128 --rounds 8:60,32:60,128:30 \
        --out docs/results/membership_no_audits.json

The rules before 2026-12-06 (a joiner enters at its round or never; nothing settles a gone
report but a probe): in a scratch copy of the repository at f6afc92,

    git apply docs/results/membership_scale_before.patch
    python bench/membership_scale.py --out docs/results/membership_scale_before.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

from noloco_swarm.peer.directory import bucket_key, gone_key, subkey_of
from noloco_swarm.peer.net import identity
from noloco_swarm.protocol import codec, records, rpc
from noloco_swarm.sim.membership import Churn, Dht, Partition, Scenario, simulate

RUN = "run-12345678"
DHTS = {
    "fast": (Dht(), ()),
    "slow": (Dht(delay_median=2.0, delay_sigma=1.5, late=0.1, late_rounds=2, lost=0.05, read_fail=0.05), ()),
    "partition": (Dht(), (Partition(start=240.0, seconds=90.0, share=0.25),)),
}
CHURN = Churn(
    crashes_per_hour=0.1, leaves_per_hour=0.1, stalls_per_hour=0.1, joins_per_hour=0.3, stragglers=0.1
)


def record_bytes() -> tuple[int, int]:
    """Bytes of a signed announcement and a signed gone report as a DHT node holds them."""
    me, other = identity.fresh(), identity.fresh()
    validator = me.validator()

    def size(key: str, record: records.PeerAnnouncement | records.GoneReport) -> int:
        subkey = MSGPackSerializer.dumps(me.owned(subkey_of(record)))
        stored = DHTRecord(DHTID.generate(source=key).to_bytes(), subkey, codec.encode(record), 1e9)
        return len(subkey) + len(validator.sign_value(stored)) + 8  # + the expiration

    addresses = tuple(
        f"/ip{v}/{a}/tcp/31337/p2p/{me.peer_id}" for v, a in ((4, "203.0.113.7"), (6, "2001:db8::7"))
    )
    announcement = records.PeerAnnouncement(RUN, me.peer_id, 2, 17, addresses, "cuda", 123456)
    report = records.GoneReport(RUN, other.peer_id, me.peer_id, 17)
    return size(bucket_key(RUN, 3), announcement), size(gone_key(RUN, other.peer_id), report)


def answer_bytes() -> tuple[int, int]:
    """Bytes per peer id of a member's view, and per peer it names with two addresses, in a real
    encoded rpc.Neighbourhood (peer/neighbourhood.py), from the difference of two sizes."""
    ids = [identity.fresh().peer_id for _ in range(200)]
    stages = tuple(tuple(sorted(ids[s::4])) for s in range(4))
    addresses = [
        tuple(f"/ip{v}/{a}/tcp/31337/p2p/{p}" for v, a in ((4, "203.0.113.7"), (6, "2001:db8::7")))
        for p in ids
    ]

    def encoded(view: tuple[tuple[str, ...], ...], named: int) -> int:
        reply = rpc.Neighbourhood(RUN, 1, 5, view, tuple(ids[:named]), tuple(addresses[:named]))
        return len(codec.encode(reply))

    half = tuple(s[: len(s) // 2] for s in stages)
    per_id = (encoded(stages, 0) - encoded(half, 0)) / (len(ids) - sum(map(len, half)))
    per_contact = (encoded(stages, 100) - encoded(stages, 0)) / 100
    return round(per_id), round(per_contact)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default="8,32,128,1000")
    ap.add_argument("--dhts", default=",".join(DHTS))
    ap.add_argument("--rounds", default="8:60,32:60,128:30,1000:8", help="N:rounds, per swarm size")
    ap.add_argument(
        "--records",
        default="gossip",
        help="how records spread besides the DHT, comma-separated: dht (the peer before 2026-12-06), "
        "swap (a design the peer does not run), gossip (the peer since: sim/membership.py, Scenario.records)",
    )
    ap.add_argument(
        "--directory",
        default="spread",
        help="where the DHT holds records, comma-separated: whole (one key each for all announcements "
        "and all reports, read whole every round), spread (the peer's: a key per bucket of members and "
        "per accused, no whole read but a joiner's; needs --records gossip)",
    )
    ap.add_argument(
        "--audits",
        type=int,
        default=0,
        help="spread directory: members' own keys each member reads per round (the peer reads none)",
    )
    ap.add_argument(
        "--join",
        default="member",
        help="how a joiner finds the swarm, comma-separated: whole (the peer before 2026-12-07: it reads "
        "every bucket), member (the peer since: it asks members; sim/membership.py, Scenario.join)",
    )
    ap.add_argument(
        "--reporters",
        default="monitors",
        help="who reports a member that failed it, comma-separated: all (the peer before 2026-12-07: every "
        "member that found it) or monitors (the peer since: protocol.membership.monitors)",
    )
    ap.add_argument("--partition-max", type=int, default=256, help="the partition DHT only up to this N")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    announcement, report = record_bytes()
    view_id, contact = answer_bytes()
    rounds = dict(tuple(int(x) for x in item.split(":")) for item in args.rounds.split(","))
    runs = []
    for n in (int(x) for x in args.peers.split(",")):
        for name in args.dhts.split(","):
            if name == "partition" and n > args.partition_max:
                continue
            dht, partitions = DHTS[name]
            for spread, directory, join, reporters in (
                (s, d, j, r)
                for s in args.records.split(",")
                for d in args.directory.split(",")
                for j in args.join.split(",")
                for r in args.reporters.split(",")
            ):
                scenario = Scenario(
                    peers=n,
                    rounds=rounds[n],
                    dht=dht,
                    churn=CHURN,
                    partitions=partitions,
                    announcement_bytes=announcement,
                    report_bytes=report,
                    view_id_bytes=view_id,
                    contact_bytes=contact,
                    seed=args.seed,
                    records=spread,
                    directory=directory,
                    audits=args.audits,
                    join=join,
                    reporters=reporters,
                )
                began = time.monotonic()
                row = simulate(scenario) | {"dht": name, "seconds": round(time.monotonic() - began, 1)}
                runs.append(row | ({"records": spread} if spread != "dht" else {}) | {"reporters": reporters})
                print(json.dumps(runs[-1]), flush=True)
    if args.out is not None and args.out.exists():  # bench/big_swarm.py's real runs stay
        runs += [row for row in json.loads(args.out.read_text())["runs"] if row.get("real")]
    result = {
        "command": "python bench/membership_scale.py " + " ".join(sys.argv[1:]),
        "record_bytes": {"announcement": announcement, "gone_report": report},
        "answer_bytes": {"per_view_id": view_id, "per_contact": contact},
        "runs": runs,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
