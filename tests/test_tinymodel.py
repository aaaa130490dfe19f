"""The tiny model: deterministic offline build, served by real vLLM (CPU build)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import urllib.request

import pytest

from appliance import tinymodel


def _digest(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.iterdir()) if p.is_file()}


def test_build_is_byte_identical_and_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    a = tinymodel.build(tmp_path / "a", "tiny")
    b = tinymodel.build(tmp_path / "b", "tiny")
    assert _digest(a) == _digest(b)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(_digest(a))
    config = json.loads((a / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["num_key_value_heads"] == 2
    assert config["head_dim"] == 32 and config["dtype"] == "bfloat16"


def test_rebuild_is_skipped_unless_forced(tmp_path):
    out = tinymodel.build(tmp_path / "m", "tiny")
    weights = out / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    tinymodel.build(out, "tiny")
    assert weights.stat().st_mtime_ns == mtime
    tinymodel.build(out, "tiny", force=True)
    assert weights.stat().st_mtime_ns != mtime


def test_tokenizer_and_chat_template():
    from transformers import PreTrainedTokenizerFast

    tok = tinymodel.build_tokenizer(tinymodel.SIZES["tiny"])
    assert isinstance(tok, PreTrainedTokenizerFast)
    text = "The quick brown fox, 12345!"
    assert tok.decode(tok(text).input_ids) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_kvbench_spec_moves_real_amounts_of_kv():
    spec = tinymodel.SIZES["kvbench"]
    assert spec.kv_bytes_per_token() == 48 * 1024
    assert spec.num_key_value_heads >= 8 and spec.head_dim == 128


def test_mla_model_is_deterministic_deepseek_v2_with_an_untied_head(tmp_path):
    """vLLM's DeepseekV2 does not tie lm_head to the embeddings: a tied checkpoint served
    NaN logits (every token id 0). The latent is the width vLLM's CPU MLA kernel takes."""
    from appliance import kvbudget

    a = tinymodel.build(tmp_path / "a", "mla")
    b = tinymodel.build(tmp_path / "b", "mla")
    assert _digest(a) == _digest(b)
    config = json.loads((a / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV2ForCausalLM"]
    assert config["tie_word_embeddings"] is False
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576
    assert config["q_lora_rank"] is None
    assert config["first_k_dense_replace"] == config["num_hidden_layers"]  # no experts run
    from safetensors import safe_open

    with safe_open(str(a / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in f.keys()
    assert config["rope_parameters"]["rope_type"] == "yarn"  # as DeepSeek-V2/V3
    assert config["dtype"] == "float32"  # prefill and decode agree (see ModelSpec.dtype)
    # vLLM's auto would serve it in bf16; AMX's MLA backend takes bf16 weights only.
    assert tinymodel.SIZES["mla"].serve_args == ("--dtype", "float32", "--attention-backend",
                                                 "CPU_MLA")
    assert tinymodel.spec_of(a) == tinymodel.SIZES["mla"]
    spec = tinymodel.SIZES["mla"]
    assert spec.kv_bytes_per_token() == 2 * 576 * 4
    assert kvbudget.kv_bytes_per_token(config) == spec.kv_bytes_per_token()


def test_cli_usage_error_exits_nonzero(tmp_path):
    res = subprocess.run([sys.executable, "-m", "appliance.tinymodel", str(tmp_path), "--size",
                          "huge"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "invalid choice" in res.stderr


def _post(base: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.load(resp)


@pytest.mark.slow
def test_served_by_vllm_greedy_is_repeatable(plain_server):
    comp = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 16,
            "temperature": 0}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 16, "temperature": 0}
    first = _post(plain_server, "/v1/completions", comp)["choices"][0]
    assert first["text"] and first["finish_reason"] == "length"
    assert _post(plain_server, "/v1/completions", comp)["choices"][0]["text"] == first["text"]
    answer = _post(plain_server, "/v1/chat/completions", chat)["choices"][0]["message"]["content"]
    assert answer
    again = _post(plain_server, "/v1/chat/completions", chat)["choices"][0]["message"]["content"]
    assert again == answer
    models = json.load(urllib.request.urlopen(plain_server + "/v1/models", timeout=10))
    assert [m["id"] for m in models["data"]] == ["tiny"]
