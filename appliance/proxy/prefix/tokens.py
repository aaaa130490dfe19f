"""A prompt's token ids, as the engines will see them: vLLM's own /tokenize on a node.

Asking the engine (not a tokenizer in the proxy) keeps the ids exact by construction: the
chat template, its kwargs, the tools, special tokens and the model's tokenizer are vLLM's
own, and the proxy needs neither the model's files (it runs on another host in a cluster)
nor transformers in its image. bench/tokenize_cost.py measures what the call costs.

Prompts whose blocks hash with extra keys (cache_salt, images, LoRA adapters) or whose
template depends on fields /tokenize does not take are not tokenized: nothing is predicted
for them (None).
"""

from __future__ import annotations

from typing import Any

from appliance.proxy.openai_api import CHAT, RESPONSES, responses_messages, text_only

# Chat fields /tokenize takes and that change the rendered prompt.
_CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "add_special_tokens",
                "chat_template", "chat_template_kwargs", "tools")
# Fields that make the engine's block hashes or rendering differ from what /tokenize gives.
_UNPREDICTABLE = ("cache_salt", "reasoning_effort", "prompt_embeds", "mm_processor_kwargs",
                  "multi_modal_data")


def tokenize_body(body: dict[str, Any], route: str) -> dict[str, Any] | list[int] | None:
    """What to POST to /tokenize for this request; the ids themselves when the prompt is
    ids already; None when nothing should be predicted."""
    if any(k in body for k in _UNPREDICTABLE):
        return None
    model = body.get("model")
    if route == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(text_only(m) for m in messages):
            return None
        out: dict[str, Any] = {"model": model, "messages": messages}
        out |= {k: body[k] for k in _CHAT_FIELDS if k in body}
        return out
    if route == RESPONSES:  # rendered as chat: tokenized as the messages it renders
        rendered = responses_messages(body)
        if rendered is None:
            return None
        out = {"model": model, "messages": rendered}
        if "chat_template_kwargs" in body:
            out["chat_template_kwargs"] = body["chat_template_kwargs"]
        return out
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    if isinstance(prompt, str):
        out = {"model": model, "prompt": prompt}
        if "add_special_tokens" in body:
            out["add_special_tokens"] = body["add_special_tokens"]
        return out
    return None  # several prompts, or none



def token_ids(answer: Any) -> list[int] | None:
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if isinstance(tokens, list) and all(type(t) is int for t in tokens):
        return tokens
    return None
