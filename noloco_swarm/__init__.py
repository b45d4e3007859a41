"""noloco-swarm: volunteers train one language model together with NoLoCo over libp2p."""

__version__ = "0.1.0"
