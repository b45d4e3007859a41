"""The transport: tensor streams over libp2p, serving and its limits, the DHT node, identity, dial-back."""
