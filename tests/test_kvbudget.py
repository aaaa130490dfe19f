"""The CPU KV budget: bytes per token from config.json, whole blocks, whole MiB, a floor."""

from __future__ import annotations

import json

import pytest

from appliance import kvbudget, tinymodel
from appliance.kvbudget import MIB, ModelShapeError, kv_bytes_per_token, kv_cache_bytes


def spec_config(name: str) -> dict:
    spec = tinymodel.SIZES[name]
    return {"num_hidden_layers": spec.num_hidden_layers,
            "num_attention_heads": spec.num_attention_heads,
            "num_key_value_heads": spec.num_key_value_heads, "head_dim": spec.head_dim,
            "hidden_size": spec.hidden_size, "torch_dtype": "bfloat16",
            "max_position_embeddings": spec.max_position_embeddings}


@pytest.mark.parametrize("name", ["tiny", "kvbench"])
def test_bytes_per_token_match_the_model_builder(name):
    assert kv_bytes_per_token(spec_config(name)) == tinymodel.SIZES[name].kv_bytes_per_token()


def test_head_dim_from_hidden_size_and_dtype_sizes():
    c = {"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 512}
    assert kv_bytes_per_token(c) == 2 * 4 * 8 * 64 * 2  # MHA, bf16 by default
    assert kv_bytes_per_token({**c, "torch_dtype": "float32"}) == 2 * 4 * 8 * 64 * 4
    assert kv_bytes_per_token({**c, "dtype": "torch.float16"}) == 2 * 4 * 8 * 64 * 2
    assert kv_bytes_per_token({**c, "num_key_value_heads": 2}) == 2 * 4 * 2 * 64 * 2


def test_mla_stores_one_latent_per_layer():
    c = {"num_hidden_layers": 3, "num_attention_heads": 16, "hidden_size": 1024,
         "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    assert kv_bytes_per_token(c) == 3 * (512 + 64) * 2


def test_multimodal_configs_use_the_text_config():
    c = {"text_config": {"num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 1, "head_dim": 16}}
    assert kv_bytes_per_token(c) == 2 * 2 * 1 * 16 * 2


def test_budget_is_whole_blocks_whole_mib_and_never_below_the_floor():
    tiny = spec_config("tiny")
    assert kv_cache_bytes(tiny, 2048, 32) == kvbudget.FLOOR  # 4 MiB needed: the floor
    bench = spec_config("kvbench")
    per = tinymodel.SIZES["kvbench"].kv_bytes_per_token()
    assert kv_cache_bytes(bench, 2048, 32) == 4 * 2048 * per == 384 * MIB
    # 2000 tokens round up to 63 blocks of 32 (2016 tokens), then to a whole MiB.
    got = kv_cache_bytes(bench, 2000, 32, sequences=1)
    assert got % MIB == 0 and got >= 2016 * per > got - MIB
    assert kv_cache_bytes(tiny, 2048, 32, floor=0) == 4 * MIB


def test_kvbench_at_2048_needs_more_than_the_old_fixed_64_mib():
    """The fixed 64 MiB refused to start vLLM with this model ("0.09 GiB KV cache is
    needed"): one full-length request alone takes 96 MiB."""
    one = kv_cache_bytes(spec_config("kvbench"), 2048, 32, sequences=1, floor=0)
    assert one == 96 * MIB > 64 * MIB


def test_for_model_dir_reads_config_and_falls_back_to_the_model_length(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(spec_config("kvbench")))
    per = tinymodel.SIZES["kvbench"].kv_bytes_per_token()
    assert kvbudget.for_model_dir(tmp_path, None, 32) == 4 * 4096 * per  # max_position 4096
    assert kvbudget.for_model_dir(tmp_path, 1024, 32) == 4 * 1024 * per


@pytest.mark.parametrize("text, needle", [
    (None, "No such file"), ("{not json", "not JSON"), ("[1]", "not a JSON object"),
    ('{"num_attention_heads": 4}', "num_hidden_layers"),
])
def test_unusable_configs_say_why(tmp_path, text, needle):
    if text is not None:
        (tmp_path / "config.json").write_text(text)
    with pytest.raises(ModelShapeError, match=needle):
        kvbudget.for_model_dir(tmp_path, 2048, 32)


def test_no_length_anywhere_is_an_error(tmp_path):
    c = spec_config("tiny")
    del c["max_position_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(ModelShapeError, match="max_model_len"):
        kvbudget.for_model_dir(tmp_path, None, 32)


def test_local_node_sizes_the_kv_cache_from_the_model(tmp_path):
    from appliance.localnode import LocalNode, NodeSpec

    (tmp_path / "config.json").write_text(json.dumps(spec_config("kvbench")))
    node = LocalNode(NodeSpec(model=tmp_path, log_dir=tmp_path / "logs"))
    argv = node.decode.argv
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(384 * MIB)
    fixed = LocalNode(NodeSpec(model=tmp_path, kv_cache_bytes=128 * MIB,
                               log_dir=tmp_path / "logs"))
    assert fixed.prefill.argv[fixed.prefill.argv.index("--kv-cache-memory-bytes") + 1] == \
        str(128 * MIB)
