"""The I/O shell of a peer: hivemind DHT, libp2p transport, the run loop."""
