"""Build a small random-weight model with its own tokenizer, fully offline.

`python -m appliance.tinymodel DIR [--size tiny|kvbench|sliding|mla]` writes a directory that
`vllm serve DIR` loads with HF_HUB_OFFLINE=1. Everything is derived from fixed seeds and a
generated training text, so building the same size twice gives byte-identical files.

- tiny: 2 layers, 2 KV heads x head_dim 32 (fast; the parity tests use it).
- kvbench: 12 layers, 8 KV heads x head_dim 128, so moving KV costs what it does on real
  models (48 KiB of KV per token; 2,000 tokens = 94 MiB) for transfer benchmarks.
- sliding: 4 layers alternating sliding-window (64 tokens) and full attention, so vLLM
  keeps two KV-cache groups with their own block tables.
- mla: a DeepSeek-V2-style model (multi-head latent attention: one 576-wide latent per token
  and layer, no KV heads), 2 dense layers; the latent width is the one vLLM's CPU MLA
  kernel is built for (kv_lora_rank 512 + rope 64); YaRN rope and float32 weights, so that
  vLLM's prefill and decode paths give the same greedy tokens (see ModelSpec).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
STAMP = ".tinymodel.json"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int = 2048
    max_position_embeddings: int = 4096
    seed: int = 1234
    # Larger than the usual 0.02 so attention really mixes the context: with 0.02 a random
    # model just repeats the prompt's last token, and a test could not tell whether D used
    # P's KV or none at all.
    init_std: float = 0.1
    # "deepseek_v2": MLA; the four widths below apply to it alone. "llama": with
    # sliding_window, a hybrid model (see layer_types).
    arch: str = "qwen3"
    # Tokens each sliding-window layer attends to (0: none). Layers alternate sliding and
    # full attention, as in gpt-oss; vLLM then keeps two KV-cache groups.
    sliding_window: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek-V2/V3 ship YaRN rope; vLLM then takes its pure-torch rope path on CPU. With
    # the default rope, vLLM's CPU rope kernel rotates MLA's strided [tokens, heads, 64]
    # views wrongly (the same token gets another k_pe alone than inside a batch), so prefill
    # and decode would disagree and no parity test could pass.
    rope_yarn_factor: float = 0.0
    # MLA's prefill (SDPA) and decode (the absorbed latent kernel) round differently in
    # bf16, and this random model's logits are flat enough that 1 in 25 greedy tokens flips;
    # in float32 the two paths agree. vLLM's `--dtype auto` serves a float32 checkpoint in
    # bf16, so it is served with `serve_args`.
    dtype: str = "bfloat16"

    @property
    def elem_size(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def serve_args(self) -> tuple[str, ...]:
        """vLLM flags to serve it as stored: vLLM's `--dtype auto` turns a float32
        checkpoint into bf16. On a CPU with AMX, vLLM picks its AMX MLA backend, which
        takes bf16 weights only: a float32 MLA model asks for the reference CPU_MLA one
        (what vLLM picks anyway without AMX)."""
        if self.dtype != "float32":
            return ()
        if self.arch == "deepseek_v2":
            return ("--dtype", "float32", "--attention-backend", "CPU_MLA")
        return ("--dtype", "float32")

    def kv_bytes_per_token(self) -> int:
        elem_size = self.elem_size
        if self.arch == "deepseek_v2":  # one latent (plus its rope part) per layer
            return self.num_hidden_layers * (self.kv_lora_rank + self.qk_rope_head_dim) \
                * elem_size
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * elem_size


SIZES: dict[str, ModelSpec] = {
    "tiny": ModelSpec("tiny", num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "kvbench": ModelSpec("kvbench", num_hidden_layers=12, hidden_size=256,
                         intermediate_size=512, num_attention_heads=8, num_key_value_heads=8,
                         head_dim=128),
    "sliding": ModelSpec("sliding", num_hidden_layers=4, hidden_size=128, intermediate_size=256,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         arch="llama", sliding_window=64),
    "mla": ModelSpec("mla", num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                     num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                     arch="deepseek_v2", kv_lora_rank=512, qk_rope_head_dim=64,
                     qk_nope_head_dim=32, v_head_dim=32, rope_yarn_factor=4.0,
                     dtype="float32"),
}

_WORDS = (
    "the a an and or but if then when while of to in on at by for with from into over under "
    "prefill decode cache block token layer head model server request response stream proxy "
    "transfer memory engine network host node queue worker schedule batch prompt output input "
    "quick brown fox jumps lazy dog river mountain city garden window paper light music water "
    "is are was were be been has have had do does did can could will would should may might "
    "one two three four five six seven eight nine ten hundred thousand first last next other "
    "red green blue white black small large fast slow new old good bad high low long short "
    "run walk read write open close send receive start stop build test measure count move hold "
    "time day night year week hour minute second morning evening today tomorrow yesterday "
    "what why how where who which this that these those there here it they we you he she"
).split()


def training_text(seed: int, sentences: int = 4000) -> list[str]:
    """Deterministic text to train the tokenizer on: seeded sentences, digits, punctuation."""
    rng = random.Random(seed)
    lines = []
    for i in range(sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        words[0] = words[0].capitalize()
        tail = rng.choice([".", "!", "?", ",", ";", ":"])
        lines.append(f"{' '.join(words)}{tail} {i} {rng.randint(0, 99999)}")
    return lines


def build_tokenizer(spec: ModelSpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(spec.seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
    )


def build(out_dir: Path, size: str = "tiny", force: bool = False) -> Path:
    """Build (or reuse) the model in out_dir; returns out_dir."""
    spec = SIZES[size]
    out_dir = Path(out_dir)
    stamp = out_dir / STAMP
    wanted = {"spec": asdict(spec)}
    if not force and stamp.exists() and json.loads(stamp.read_text()).get("spec") == wanted["spec"]:
        return out_dir

    import torch
    from transformers import GenerationConfig

    tokenizer = build_tokenizer(spec)
    # Round the embedding table up so the vocabulary fits exactly as vLLM pads it.
    vocab = -(-len(tokenizer) // 64) * 64
    config, model_cls = _config(spec, vocab, tokenizer)
    torch.manual_seed(spec.seed)
    with torch.no_grad():
        model = model_cls(config).to(getattr(torch, spec.dtype))
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    wanted["files"] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                       for p in sorted(out_dir.iterdir()) if p.is_file() and p.name != STAMP}
    stamp.write_text(json.dumps(wanted, indent=1, sort_keys=True))
    return out_dir


def spec_of(model_dir: Path) -> ModelSpec:
    """The spec a built model directory was made from (its stamp)."""
    return SIZES[json.loads((Path(model_dir) / STAMP).read_text())["spec"]["name"]]


def _config(spec: ModelSpec, vocab: int, tokenizer: Any) -> tuple[Any, Any]:
    """The Hugging Face config and model class of a spec."""
    common = dict(
        vocab_size=vocab, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        # vLLM's DeepseekV2 never ties lm_head to the embeddings: a tied checkpoint (no
        # lm_head.weight) leaves it unloaded and every logit NaN.
        tie_word_embeddings=spec.arch != "deepseek_v2",
        initializer_range=spec.init_std, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None, torch_dtype=spec.dtype)
    if spec.arch == "deepseek_v2":
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        # Every layer dense (first_k_dense_replace = all): the expert fields must still be
        # set, and are never used.
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        if spec.rope_yarn_factor:
            rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": spec.rope_yarn_factor,
                    "original_max_position_embeddings": int(
                        spec.max_position_embeddings / spec.rope_yarn_factor),
                    "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
        return DeepseekV2Config(
            **common, rope_parameters=rope, kv_lora_rank=spec.kv_lora_rank, q_lora_rank=None,
            qk_rope_head_dim=spec.qk_rope_head_dim, qk_nope_head_dim=spec.qk_nope_head_dim,
            v_head_dim=spec.v_head_dim, first_k_dense_replace=spec.num_hidden_layers,
            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
            moe_intermediate_size=spec.intermediate_size // 4), DeepseekV2ForCausalLM
    if spec.arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        # vLLM's Llama reads layer_types and sliding_window (Hugging Face's Llama ignores
        # them; only vLLM serves this model).
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                       for i in range(spec.num_hidden_layers)]
        return LlamaConfig(**common, head_dim=spec.head_dim, layer_types=layer_types,
                           sliding_window=spec.sliding_window), LlamaForCausalLM
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3Config(**common, head_dim=spec.head_dim), Qwen3ForCausalLM


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m appliance.tinymodel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args(argv)
    try:
        build(args.out_dir, args.size, args.force)
    except OSError as exc:
        print(f"tinymodel: error: {exc}", file=sys.stderr)
        return 1
    print(args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
