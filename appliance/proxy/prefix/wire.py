"""vLLM's KV-event messages as they arrive on the wire (msgpack, vllm.distributed.kv_events).

A batch is an array [ts, events, data_parallel_rank]; each event a map tagged with its class
name under "type". Fields this proxy does not read are ignored, so newer engines that add
fields still decode.
"""

from __future__ import annotations

import msgspec

# Hashes are ints (the low 64 bits, vLLM's default) or the whole digest.
Hash = int | bytes


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    extra_keys: list[list[object] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(Batch)
