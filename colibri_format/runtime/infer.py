"""One generation from a `.colibri` file, as a library call: a prompt (text, chat or token ids) in, a dict out.

`run_infer` is what `colibri infer` runs; `prompt_token_ids` and `text_streamer` are shared with the
expert-parallel ranks (runtime/parallel/run.py), so both give the same prompt handling and the same stream.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from colibri_format.errors import InvalidInput
from colibri_format.runtime import Engine, EngineConfig


def prompt_token_ids(engine: Engine, prompt: str | None, ids: list[int] | None, chat: bool) -> list[int]:
    """The prompt as token ids: `ids` as given, or `prompt` encoded (through the chat template with `chat`)."""
    if (prompt is None) == (ids is None):
        raise InvalidInput("give exactly one of a text prompt or token ids", field="prompt")
    if ids is not None:
        return list(ids)
    if engine.tokenizer is None:
        raise InvalidInput("this file embeds no tokenizer: pass token ids instead of text", field="prompt")
    if chat:
        return engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    return engine.tokenizer.encode(prompt)


def text_streamer(engine: Engine, stream: Callable[[str], Any] | None) -> Callable[[int], None] | None:
    """A generate() callback that hands `stream` each newly decoded piece of text (None: nothing to stream)."""
    if stream is None or engine.tokenizer is None:
        return None
    out: list[int] = []
    shown = [""]

    def on_token(token: int) -> None:
        out.append(token)
        text = engine.tokenizer.decode(out)
        if text.startswith(shown[0]) and len(text) > len(shown[0]):   # wait while a multi-byte char is partial
            stream(text[len(shown[0]):])
            shown[0] = text

    return on_token


def run_infer(path: str | os.PathLike, prompt: str | None = None, *, ids: list[int] | None = None,
              chat: bool = False, max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
              seed: int | None = None, stream: Callable[[str], Any] | None = None,
              **config: Any) -> dict[str, Any]:
    """Generate from a `.colibri` file. `config` takes EngineConfig fields (device, max_cached_experts, ...).

    Returns {"prompt_ids", "output_ids", "text", "finish_reason", "stats"}; raises ColibriFormatError
    subclasses for a bad file or bad arguments.
    """
    with Engine(path, EngineConfig(**config)) as engine:
        prompt_ids = prompt_token_ids(engine, prompt, ids, chat)
        result = engine.generate(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                 seed=seed, callback=text_streamer(engine, stream))
    stats = result.stats.as_dict()
    return {"prompt_ids": prompt_ids, "output_ids": result.output_ids, "text": result.text,
            "finish_reason": stats.pop("finish_reason"), "stats": stats}
