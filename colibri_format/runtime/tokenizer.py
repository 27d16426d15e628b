"""Text <-> token ids from the tokenizer a `.colibri` file embeds (`metadata["tokenizer"]`).

Uses the `tokenizers` library on the embedded `tokenizer_json`. Chat formatting renders the embedded
`tokenizer_config["chat_template"]` with jinja2, imported only when a chat prompt is built: jinja2 is an optional
dependency. Stop tokens come from `generation_config["eos_token_id"]`, else the tokenizer's eos token.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from colibri_format.errors import InvalidInput, InvalidMetadata


def _token_text(token: Any) -> str | None:
    """Special tokens appear as plain strings or as serialized AddedToken dicts ({"content": ...})."""
    return token.get("content") if isinstance(token, dict) else token


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


class Tokenizer:
    def __init__(self, tokenizer_json: str, tokenizer_config: dict | None = None,
                 generation_config: dict | None = None) -> None:
        from tokenizers import Tokenizer as _HFTokenizer  # optional at import time of the runtime

        try:
            self._tok = _HFTokenizer.from_str(tokenizer_json)
        except Exception as exc:  # the tokenizers library raises a bare Exception on bad JSON
            raise InvalidMetadata(f"embedded tokenizer_json does not load: {exc}", field="tokenizer") from None
        self.config = tokenizer_config or {}
        self.generation_config = generation_config or {}

    @classmethod
    def from_metadata(cls, metadata: dict) -> "Tokenizer | None":
        entry = (metadata or {}).get("tokenizer")
        if not entry or not entry.get("tokenizer_json"):
            return None
        return cls(entry["tokenizer_json"], entry.get("tokenizer_config"), entry.get("generation_config"))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def special_token(self, name: str) -> str | None:
        return _token_text(self.config.get(name))

    @property
    def stop_ids(self) -> list[int]:
        ids = _as_list(self.generation_config.get("eos_token_id"))
        if ids:
            return ids
        eos = self.special_token("eos_token")
        token_id = self._tok.token_to_id(eos) if eos else None
        return [token_id] if token_id is not None else []

    @property
    def chat_template(self) -> str | None:
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        template = self.chat_template
        if not template:
            raise InvalidInput("this file's tokenizer has no chat template", field="tokenizer_config.chat_template")
        return _render(template, messages=messages, add_generation_prompt=add_generation_prompt,
                       bos_token=self.special_token("bos_token") or "",
                       eos_token=self.special_token("eos_token") or "")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # The template already writes every special token (bos included), so none are added again.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


def _render(template: str, **context: Any) -> str:
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ImportError("chat formatting needs jinja2, an optional dependency: pip install jinja2") from None

    def raise_exception(message: str) -> None:
        raise InvalidInput(f"chat template refused the messages: {message}", field="messages")

    # The file's template is untrusted input: a sandboxed environment, as the template authors expect.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template).render(**context)
