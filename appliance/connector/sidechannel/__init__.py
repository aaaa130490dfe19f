"""The connector's ends of the side channel between D and P workers (docs/protocol.md steps
4, 19-22): D's layout on the wire, P's checks before it acts, D's sockets, the producer
lookup, the loop it runs on, and P's registration with the bootstrap sidecar. The messages
and CURVE are `appliance.sidechannel`, shared with the proxy.
"""
