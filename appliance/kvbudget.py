"""How much KV cache a CPU server gets, from the model's own config.

On a GPU vLLM sizes its KV cache from `--gpu-memory-utilization`; on a CPU it needs a byte
count (`--kv-cache-memory-bytes`), and a fixed one either wastes memory on a small model or
refuses to start on a larger one ("... KV cache is needed, which is larger than the
available KV cache memory"). The budget holds `sequences` requests of `max_model_len`
tokens each, never less than `floor`. Pure arithmetic over config.json; nothing imported
from vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MIB = 1 << 20
FLOOR = 64 * MIB
SEQUENCES = 4
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2,
                "float8_e4m3fn": 1, "fp8": 1}


class ModelShapeError(ValueError):
    """config.json lacks what the KV size follows from."""


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    # Multimodal configs keep the language model's shape in a sub-config.
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int | None = None) -> int:
    """Bytes of KV one token occupies across all layers (K and V, or MLA's one latent)."""
    c = _text_config(config)
    try:
        layers = int(c["num_hidden_layers"])
        if dtype_bytes is None:
            dtype = str(c.get("torch_dtype") or c.get("dtype") or "bfloat16")
            dtype_bytes = _DTYPE_BYTES.get(dtype.removeprefix("torch."), 2)
        if c.get("kv_lora_rank"):  # MLA: one latent vector plus the rope part per layer
            return layers * (int(c["kv_lora_rank"]) + int(c.get("qk_rope_head_dim", 0))) \
                * dtype_bytes
        heads = int(c.get("num_key_value_heads") or c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // int(c["num_attention_heads"]))
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise ModelShapeError(f"config.json has no usable {exc} for the KV size") from None
    return 2 * layers * heads * head_dim * dtype_bytes


def model_max_len(config: dict[str, Any]) -> int | None:
    value = _text_config(config).get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


def kv_cache_bytes(config: dict[str, Any], max_model_len: int, block_size: int,
                   sequences: int = SEQUENCES, floor: int = FLOOR) -> int:
    """The KV budget for `sequences` full-length requests, whole MiB, at least `floor`."""
    if max_model_len < 1 or block_size < 1 or sequences < 1:
        raise ValueError("max_model_len, block_size and sequences must be positive")
    tokens = -(-max_model_len // block_size) * block_size  # whole blocks
    need = kv_bytes_per_token(config) * tokens * sequences
    return max(floor, -(-need // MIB) * MIB)


def read_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ModelShapeError(f"{path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ModelShapeError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ModelShapeError(f"{path}: not a JSON object")
    return data


def budget(explicit: int | None, model_dir: str | Path, max_model_len: int | None,
           block_size: int) -> int:
    """The bytes a server gets: the configured number, or else sized from the model."""
    return explicit if explicit is not None else \
        for_model_dir(model_dir, max_model_len, block_size)


def for_model_dir(model_dir: str | Path, max_model_len: int | None, block_size: int,
                  sequences: int = SEQUENCES) -> int:
    config = read_config(model_dir)
    length = max_model_len or model_max_len(config)
    if length is None:
        raise ModelShapeError(f"{model_dir}: no max_model_len given and config.json has no "
                              f"max_position_embeddings")
    return kv_cache_bytes(config, length, block_size, sequences)
