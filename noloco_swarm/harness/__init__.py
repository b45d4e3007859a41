"""Starting whole swarms: peer processes on this machine (local.py), each peer in its own network
namespace (namespaces.py), and the docker-compose testbed (compose.py). `noloco local`, `noloco
testbed`, the benches and the tests drive them; this package sits under cli/ and imports none of it."""
