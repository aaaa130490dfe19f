"""Moving one request's KV (docs/protocol.md steps 14, 22-32): the transport interface and
Mooncake's, P's pushes and its ledger of held blocks, D's pulls, and each transfer's
explicit state.
"""
