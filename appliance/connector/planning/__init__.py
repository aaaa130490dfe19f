"""Pure transfer planning (docs/protocol.md steps 3, 28): KV regions from tensor layouts,
KV-cache groups, heterogeneous TP, descriptors. Plain ints and tuples: nothing here touches
torch, Mooncake or sockets.
"""
