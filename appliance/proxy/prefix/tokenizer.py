"""A prompt's token ids in the proxy's own process: the model's tokenizer (`tokenizers`) and
chat template (jinja2, rendered as transformers renders it), when the proxy is given the
model's tokenizer folder (`--tokenizer`; `pdctl up --local` gives it).

Asking a D's /tokenize (appliance.proxy.prefix.tokens) costs a round trip to an API server
that shares D's core: 2-5 ms idle, 8-30 ms on a D that streams (bench/tokenize_cost.py, and
the access line's tokenize_ms); in process it is 0.1-2 ms. vLLM's rendering has options this
does not take (tools, a request's own template, continuing the final message, content in
parts): those prompts still go to /tokenize. And the ids must be the engine's, so they are
checked against its /tokenize (`Checks`): the first prompts of each kind and one in
`every` after; one difference turns the in-process tokenizer off for good.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

log = logging.getLogger("appliance.proxy.prefix")

# Chat fields this renders as vLLM does; any other template field goes to /tokenize.
_CHAT_FIELDS = {"model", "messages", "add_generation_prompt", "add_special_tokens",
                "chat_template_kwargs"}
_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
            "mask_token")


class TokenizerUnavailable(Exception):
    """The folder or the packages an in-process tokenizer needs are not there."""


def folder_error(path: str) -> str | None:
    """Why `path` is not a tokenizer folder (None: it is one)."""
    p = Path(path)
    if not p.is_dir():
        return f"{path} is not a folder"
    if not (p / "tokenizer.json").is_file():
        return f"{path} has no tokenizer.json (a fast tokenizer's file)"
    return None


def folder_of(model: str) -> str | None:
    """The tokenizer folder of a model that vLLM serves: the model's own folder, or its
    snapshot in the Hugging Face cache once downloaded (None: neither is here yet)."""
    if folder_error(model) is None:
        return str(Path(model).resolve())
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model, "tokenizer.json")
    except Exception:  # noqa: BLE001 - not a repository id: nothing cached
        return None
    return str(Path(found).parent) if isinstance(found, str) else None


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """The model's default chat template: transformers' chat_template.jinja, else the one in
    tokenizer_config.json (a string, or named templates of which `default`)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    out = {}
    for name in _SPECIAL:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def _environment() -> Any:
    """A jinja2 environment as transformers compiles chat templates in: sandboxed, blocks
    trimmed, loop controls, its own tojson, raise_exception and strftime_now."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class InProcess:
    """The model's tokenizer and chat template, loaded once."""

    def __init__(self, folder: str) -> None:
        why = folder_error(folder)
        if why is not None:
            raise TokenizerUnavailable(why)
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise TokenizerUnavailable("the tokenizers package is not installed") from exc
        path = Path(folder)
        try:
            self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
            config_file = path / "tokenizer_config.json"
            config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception
            raise TokenizerUnavailable(f"{folder}: {exc}") from exc
        self.special = _special_tokens(config)
        self.template: Any = None
        source = _chat_template(path, config)
        if source is not None:
            try:
                self.template = _environment().from_string(source)
            except ImportError:
                log.warning("jinja2 is not installed: chat prompts are tokenized by a D")
            except Exception as exc:  # noqa: BLE001 - a template jinja2 cannot compile
                log.warning("the chat template of %s does not compile here (%s): chat "
                            "prompts are tokenized by a D", folder, exc)

    def ids(self, what: dict[str, Any]) -> list[int] | None:
        """The ids of a /tokenize body (appliance.proxy.prefix.tokens.tokenize_body), or
        None when this cannot render it as vLLM would."""
        if "messages" in what:
            return self._chat(what)
        prompt = what.get("prompt")
        if not isinstance(prompt, str):
            return None
        return self.tokenizer.encode(prompt, add_special_tokens=bool(
            what.get("add_special_tokens", True))).ids

    def _chat(self, what: dict[str, Any]) -> list[int] | None:
        if self.template is None or not what.keys() <= _CHAT_FIELDS:
            return None
        messages = what["messages"]
        if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
            return None  # parts: vLLM joins or keeps them by the template's content format
        kwargs = what.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            return None
        try:
            text = self.template.render(**{**self.special, **kwargs, "messages": messages,
                                           "tools": None, "documents": None,
                                           "add_generation_prompt": bool(
                                               what.get("add_generation_prompt", True))})
        except Exception:  # noqa: BLE001 - the engine answers with its own error
            return None
        return self.tokenizer.encode(text, add_special_tokens=bool(
            what.get("add_special_tokens", False))).ids


@dataclass
class Checks:
    """When to check the in-process ids against the engine's, and what the checks found:
    the first `first` prompts of each kind (completion, chat), then one in `every`."""

    first: int = 8
    every: int = 64
    counts: dict[str, int] = field(default_factory=dict)  # prompts tokenized, per kind
    agreed: dict[str, int] = field(default_factory=dict)  # checks passed, per kind
    differed: str = ""  # the first difference found (the tokenizer is off from then on)

    def due(self, kind: str) -> bool:
        n = self.counts[kind] = self.counts.get(kind, 0) + 1
        return n <= self.first or n % self.every == 0

    def compare(self, kind: str, mine: list[int], engine: list[int]) -> bool:
        if mine == engine:
            self.agreed[kind] = self.agreed.get(kind, 0) + 1
            return True
        at = next((i for i, (a, b) in enumerate(zip(mine, engine, strict=False)) if a != b),
                  min(len(mine), len(engine)))
        self.differed = (f"a {kind} prompt: {len(mine)} ids here, {len(engine)} from the "
                         f"engine, first different at {at}")
        return False
