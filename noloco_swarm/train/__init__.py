"""What the simulator and the peer share: the typed run config and one stage replica."""
