"""The side channel's wire, below both of its speakers (docs/protocol.md steps 21, 30): its
messages (`messages`) and its CURVE authentication (`curve`). P's and D's connector workers
(`appliance.connector.sidechannel`: P's checks, D's sockets, the loop) and the proxy's KV
releaser (`appliance.proxy.ownership.release`) import it; it imports neither, and needs no
numpy, torch or vLLM.
"""
