"""The side channel between D and P workers (docs/protocol.md steps 4, 19-22): its
messages, CURVE, P's checks before it acts, D's sockets, the producer lookup, the loop it
runs on, and P's registration with the bootstrap sidecar.
"""
