"""Generation from a `.colibri` file as library calls: one prompt in, a dict out (`run_infer`), or a conversation
kept through the file's chat template (`ChatSession`).

`prompt_token_ids` and `text_streamer` are shared with the expert-parallel ranks (runtime/parallel/run.py), so
both give the same prompt handling and the same stream. A `StopRequest` (set from a Ctrl-C handler) ends a
generation cleanly at the next token: the result, its stats and the routing trace are complete up to there.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from colibri_format.errors import InvalidInput, SequenceTooLong
from colibri_format.runtime import Engine, EngineConfig
from colibri_format.runtime.inputs import check_ids, check_text_fits, utf8_text
from colibri_format.runtime.sampling import StopStrings, check_sampling, find_stop, partial_stop

# Special tokens that end a turn in the chat templates in use; stops for chat prompts when the vocabulary has them.
TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>")


def chat_messages(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": prompt}]


def prompt_token_ids(engine: Engine, prompt: str | None, ids: list[int] | None, chat: bool,
                     system: str | None = None) -> list[int]:
    """The prompt as token ids: `ids` as given, or `prompt` encoded (through the chat template with `chat`, after
    the `system` message if any)."""
    if (prompt is None) == (ids is None):
        raise InvalidInput("give exactly one of a text prompt or token ids", field="prompt")
    if ids is not None:
        if system is not None:
            raise InvalidInput("a system prompt needs a text prompt, not token ids", field="system")
        return list(ids)
    if engine.tokenizer is None:
        raise InvalidInput("this file embeds no tokenizer: pass token ids instead of text", field="prompt")
    prompt = utf8_text(prompt, "prompt")
    system = None if system is None else utf8_text(system, "system")
    check_text_fits(prompt if system is None else prompt + system, engine.tokenizer, engine.config.max_seq_len)
    if chat or system is not None:
        return engine.tokenizer.encode_chat(chat_messages(prompt, system))
    return engine.tokenizer.encode(prompt)


def chat_stop_ids(tokenizer) -> list[int]:
    """The tokenizer's end tokens plus the end-of-turn special tokens its vocabulary holds."""
    ids = list(tokenizer.stop_ids)
    for text in TURN_END_TOKENS:
        found = tokenizer.encode(text, add_special_tokens=False)
        if len(found) == 1 and tokenizer.decode(found, skip_special_tokens=False) == text and found[0] not in ids:
            ids.append(found[0])
    return ids


class TextStream:
    """A generate() callback that hands `stream` each newly decoded piece of text: never a partial UTF-8
    character, never a stop string or what could be its start. `finish(text)` writes what is still held back.

    Incremental detokenization: each token decodes only a short window of ids (from the token before the last
    piece taken, for context such as a leading space, to the end), and the new text is taken once it no longer
    ends in U+FFFD, the mark of a character whose bytes are split across tokens and not all here yet. What is
    written is a prefix of the final decode for every decoder whose text only grows at the end as ids are added
    (byte-level BPE, byte-fallback SentencePiece), and the work per token does not grow with the output (while
    the output is valid UTF-8). Stop strings are searched in the text not yet written only: a match cannot begin
    in written text, since the end of the text that could begin one is always held back.
    """

    def __init__(self, tokenizer, stream: Callable[[str], Any], stop_strings: Sequence[str] = ()) -> None:
        self.tokenizer, self.stream, self.stop = tokenizer, stream, tuple(stop_strings)
        self.ids: list[int] = []  # the window: the ids of the last piece taken (context), then those pending
        self.read = 0             # the ids before this are the context (their text taken)
        self.pending = ""        # decoded, not written: a possible start of a stop string
        self.shown = 0           # characters written to `stream`
        self.stopped = False     # a stop string was found: nothing more is written but by finish

    def __call__(self, token: int) -> None:
        self.ids.append(int(token))
        before = self.tokenizer.decode(self.ids[:self.read])
        after = self.tokenizer.decode(self.ids)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return                               # nothing new yet, or a character still incomplete
        del self.ids[:self.read]                 # the new window starts at the piece just taken
        self.read = len(self.ids)
        if not self.stopped:
            self._pass(self.pending + after[len(before):])

    def _pass(self, pending: str) -> None:
        ready = len(pending)
        if self.stop:
            at = find_stop(pending, self.stop)
            self.stopped = at >= 0
            ready = at if self.stopped else ready - partial_stop(pending, self.stop)
        if ready > 0:
            self.stream(pending[:ready])
            self.shown += ready
        self.pending = pending[ready:]

    def finish(self, text: str | None) -> None:
        """Write the rest of `text` (the generation's final decode, cut at a stop string) after what was written:
        a character cut short at the end of the output appears here, as the final decode has it (U+FFFD)."""
        if text is not None and len(text) > self.shown:
            self.stream(text[self.shown:])
            self.shown = len(text)


def text_streamer(engine: Engine, stream: Callable[[str], Any] | None,
                  stop_strings: Sequence[str] = ()) -> TextStream | None:
    """A TextStream over the engine's tokenizer (None: nothing to stream, or no tokenizer to decode with)."""
    if stream is None or engine.tokenizer is None:
        return None
    return TextStream(engine.tokenizer, stream, stop_strings)


class StopRequest:
    """`requested` ends the running generation at its next token (set it from a signal handler); `armed` is True
    while a generation runs, so a handler can tell a generation from the set-up before it."""

    def __init__(self) -> None:
        self.armed = False
        self.requested = False


def _generate(engine: Engine, prompt_ids: list[int], streamer: TextStream | None, stop_request: StopRequest | None,
              **kwargs: Any):
    def on_token(token: int) -> bool:
        if streamer is not None:
            streamer(token)
        return not (stop_request is not None and stop_request.requested)

    if stop_request is not None:
        stop_request.armed = True
    try:
        result = engine.generate(prompt_ids, callback=on_token, **kwargs)
    finally:
        if stop_request is not None:
            stop_request.armed = False
    if streamer is not None:
        streamer.finish(result.text)
    return result


def _as_dict(prompt_ids: list[int], result, stop_request: StopRequest | None) -> dict[str, Any]:
    stats = result.stats.as_dict()
    reason = stats.pop("finish_reason")
    if stop_request is not None and stop_request.requested and reason == "callback":
        reason = "interrupted"
    return {"prompt_ids": prompt_ids, "output_ids": result.output_ids, "text": result.text,
            "finish_reason": reason, "stats": stats}


def run_infer(path: str | os.PathLike, prompt: str | None = None, *, ids: list[int] | None = None,
              chat: bool = False, system: str | None = None, max_new_tokens: int = 32, temperature: float = 0.0,
              top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, repetition_penalty: float = 1.0,
              stop_strings: Sequence[str] | None = None, seed: int | None = None,
              stream: Callable[[str], Any] | None = None, echo: bool = False,
              stop_request: StopRequest | None = None, **config: Any) -> dict[str, Any]:
    """Generate from a `.colibri` file. `config` takes EngineConfig fields (device, max_cached_experts, ...).

    `system` implies `chat`. With `echo`, a plain text prompt goes to `stream` first, once every input is
    checked. Returns {"prompt_ids", "output_ids", "text", "finish_reason", "stats"} (finish_reason
    "interrupted" when `stop_request` ended it); raises ColibriFormatError subclasses for a bad file or bad
    arguments, before anything is streamed.
    """
    chat = chat or system is not None
    with Engine(path, EngineConfig(**config)) as engine:
        prompt_ids = prompt_token_ids(engine, prompt, ids, chat, system)
        check_ids(prompt_ids, engine.vocab_size, engine.config.max_seq_len)
        check_sampling(temperature, top_p, top_k, min_p, repetition_penalty)
        stops = StopStrings(stop_strings or (), engine.tokenizer).strings
        streamer = text_streamer(engine, stream, stops)
        if echo and stream is not None and prompt is not None and not chat:
            stream(prompt)
        result = _generate(engine, prompt_ids, streamer, stop_request, max_new_tokens=max_new_tokens,
                           temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                           repetition_penalty=repetition_penalty, stop_strings=stops or None, seed=seed,
                           stop_ids=chat_stop_ids(engine.tokenizer) if chat else None)
    return _as_dict(prompt_ids, result, stop_request)


class ChatSession:
    """A conversation over one open engine. Each turn renders the whole history (system message, then user and
    assistant turns) through the file's chat template and generates the reply; nothing is cached between turns.
    When the history outgrows max_seq_len the oldest exchanges are dropped."""

    def __init__(self, engine: Engine, system: str | None = None, *, max_new_tokens: int = 256,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                 repetition_penalty: float = 1.0, stop_strings: Sequence[str] | None = None,
                 seed: int | None = None) -> None:
        if engine.tokenizer is None:
            raise InvalidInput("chat needs a tokenizer, and this file embeds none", field="tokenizer")
        check_sampling(temperature, top_p, top_k, min_p, repetition_penalty)
        self.engine, self.seed, self.turns = engine, seed, 0
        self.system = None if system is None else utf8_text(system, "system")
        self.stops = StopStrings(stop_strings or (), engine.tokenizer).strings
        self.sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                         "top_k": top_k, "min_p": min_p, "repetition_penalty": repetition_penalty}
        self.stop_ids = chat_stop_ids(engine.tokenizer)
        self.history: list[dict[str, str]] = []
        self._encode([{"role": "user", "content": "hi"}])          # the template renders, before the first turn

    def _encode(self, history: list[dict[str, str]]) -> list[int]:
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        return self.engine.tokenizer.encode_chat(system + history)

    def _fit(self, history: list[dict[str, str]]) -> tuple[list[dict[str, str]], list[int]]:
        """The history without its oldest exchanges until the prompt leaves room for one new token."""
        limit = self.engine.config.max_seq_len
        ids = self._encode(history)
        while len(ids) >= limit and len(history) > 2:
            history = history[2:]
            ids = self._encode(history)
        if len(ids) >= limit:
            raise SequenceTooLong(f"the message takes {len(ids)} tokens, over max_seq_len={limit}",
                                  field="message", value=len(ids))
        return history, ids

    def reply(self, message: str | bytes, stream: Callable[[str], Any] | None = None,
              stop_request: StopRequest | None = None) -> dict[str, Any]:
        """Answer `message`; the reply (or its part before a Ctrl-C) joins the history."""
        message = utf8_text(message, "message")
        check_text_fits(message, self.engine.tokenizer, self.engine.config.max_seq_len, "message")
        history, ids = self._fit(self.history + [{"role": "user", "content": message}])
        streamer = text_streamer(self.engine, stream, self.stops)
        seed = None if self.seed is None else self.seed + self.turns
        result = _generate(self.engine, ids, streamer, stop_request, stop_ids=self.stop_ids,
                           stop_strings=self.stops or None, seed=seed, **self.sampling)
        self.history = history + [{"role": "assistant", "content": result.text or ""}]
        self.turns += 1
        return _as_dict(ids, result, stop_request)
