"""vLLM's prefix-cache block hashes, computed from a prompt's token ids (pure).

The engines run with `--prefix-caching-hash-algo sha256_cbor`: a block's hash is SHA-256 of
the canonical CBOR of (parent block's hash, the block's token ids, extra keys), the first
block's parent being NONE_HASH = sha256_cbor(seed). The seed is vLLM's fixed default unless
PYTHONHASHSEED is set in the engine's environment (then that string). KV events carry the
hash's low 64 bits as an int (vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, on by default),
so lookups use those.

Only full blocks are hashed; a prompt with extra keys (LoRA, multimodal, cache_salt) hashes
differently and is not predicted (the caller leaves such prompts out).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache

import cbor2

DEFAULT_SEED = "vllm-none-hash"
_LOW64 = (1 << 64) - 1


def sha256_cbor(obj: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


@lru_cache(maxsize=8)
def none_hash(seed: str = DEFAULT_SEED) -> bytes:
    return sha256_cbor(seed)


def block_hash(parent: bytes | None, tokens: Sequence[int], seed: str = DEFAULT_SEED) -> bytes:
    return sha256_cbor((parent or none_hash(seed), tuple(tokens), None))


def external(h: bytes) -> int:
    """The hash as KV events carry it."""
    return int.from_bytes(h, "big") & _LOW64


def chain(token_ids: Sequence[int], block_size: int, seed: str = DEFAULT_SEED) -> list[bytes]:
    """The hashes of the prompt's full blocks, first to last."""
    out: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start:start + block_size], seed)
        out.append(parent)
    return out
