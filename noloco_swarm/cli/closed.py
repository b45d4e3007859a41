"""`noloco authority` and `noloco ticket`: the organiser's side of a closed run (peer/tickets.py)."""

from __future__ import annotations

import time
from pathlib import Path

from noloco_swarm.peer import tickets
from noloco_swarm.peer.net import identity


def run_authority(out: Path) -> int:
    """Make the run's authority key in `out` (kept by the organiser, never shared) and print the
    public key that the run's config names."""
    if out.exists():
        print(f"noloco: {out} exists; the authority of a run is made once (delete it to start over)")
        return 1
    out.parent.mkdir(parents=True, exist_ok=True)
    identity.generate(out)
    public = tickets.public_key_text(identity.load(out).key)
    print(f"Authority key written to {out}: keep it private; it issues the run's tickets.")
    print("Put this in the run's config (every peer's, e.g. --config run.toml):")
    print(f'authority = "{public}"')
    return 0


def run_ticket(
    authority: Path, run_id: str, peer_id: str | None, identity_path: Path | None, hours: float, out: Path
) -> int:
    """Issue a join ticket for one peer (named by its id, or by its identity file) in `out`."""
    if (peer_id is None) == (identity_path is None):
        print("noloco: name the peer with exactly one of --peer-id and --identity")
        return 2
    if not hours > 0:
        print("noloco: --hours must be > 0")
        return 2
    key = identity.load(authority).key
    peer = peer_id if peer_id is not None else identity.load(identity_path).peer_id  # type: ignore[arg-type]
    expires = time.time() + hours * 3600
    ticket = tickets.issue(key, run_id, peer, expires)
    tickets.write(ticket, out)
    print(f"Ticket for {peer} in run {run_id!r}, valid {hours:g} h, written to {out}.")
    print(f"The peer joins with: --identity <its key file> --set peer.ticket={out}")
    return 0
