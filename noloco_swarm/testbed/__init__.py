"""Network-namespace testbed: hosts on one bridge, links cut, shaped and delayed (`noloco testbed`).

It starts processes only; it imports nothing else of the project. See docs/testbed.md.
"""

from noloco_swarm.testbed.bed import Host, Testbed, TestbedError, namespaces_permitted
from noloco_swarm.testbed.delay import DelayRelay, Route

__all__ = ["DelayRelay", "Host", "Route", "Testbed", "TestbedError", "namespaces_permitted"]
