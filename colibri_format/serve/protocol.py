"""The OpenAI wire format: request bodies checked into a prompt (token ids) and `SamplingParams`, responses and
stream chunks built, every refusal one `ApiError` with an OpenAI-style body:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Nothing here imports the web stack; the app (app.py) calls `parse_completion` / `parse_chat` off the event loop
(they tokenize and render the chat template) and turns the scheduler's events into the objects built here.

Fields taken: `model` (any name is served by the one model), `prompt` (text, one text in a list, or token ids) or
`messages` (system / developer / user / assistant; text content or text parts) through the file's embedded chat
template, `max_tokens` (`max_completion_tokens`), `temperature`, `top_p`, `seed`, `stop` (a string or a list),
`stream`, `stream_options.include_usage`; the extensions `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`
(no stop token) and `return_token_ids` (the ids beside the text) as vLLM spells them. Other fields are ignored
when they ask for the default (`n: 1`, `presence_penalty: 0`, ...) and refused otherwise. Sampling defaults are
OpenAI's (temperature 1, top_p 1) unless the file's generation_config sets them, as vLLM does.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from colibri_format.errors import ColibriFormatError, SequenceTooLong
from colibri_format.runtime.inputs import check_ids, check_text_fits, utf8_text
from colibri_format.runtime.sampling import check_sampling, check_stop_strings

from .scheduler import SamplingParams

MAX_BODY_BYTES = 64 << 20          # a request body; far above any prompt max_seq_len tokens can hold
DEFAULT_COMPLETION_TOKENS = 16      # OpenAI's default max_tokens for /v1/completions
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Fields accepted only at the value that changes nothing.
NEUTRAL = {"n": (1, None), "best_of": (1, None), "echo": (False, None), "logprobs": (None, False, 0),
           "top_logprobs": (None, 0), "presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None),
           "logit_bias": (None,), "suffix": (None, ""), "tools": (None,), "functions": (None,),
           "tool_choice": (None, "none"), "response_format": (None,)}
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class ApiError(Exception):
    """A refusal with its HTTP status and the OpenAI error fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def library_error(exc: ColibriFormatError, param: str | None = None) -> ApiError:
    """A library refusal (bad value, prompt too long, chat template refused) as a 400."""
    code = "context_length_exceeded" if isinstance(exc, SequenceTooLong) else None
    return ApiError(400, str(exc), param=param or exc.field, code=code)


@dataclass(frozen=True)
class ModelInfo:
    """What request checks need to know of the served model."""
    id: str
    tokenizer: Any
    vocab_size: int
    max_seq_len: int
    created: int = 0
    stop_ids: tuple[int, ...] = ()
    chat_stop_ids: tuple[int, ...] = ()
    defaults: dict[str, Any] = field(default_factory=dict)     # sampling defaults from generation_config

    def card(self) -> dict[str, Any]:
        return {"id": self.id, "object": "model", "created": self.created, "owned_by": "colibri",
                "max_model_len": self.max_seq_len}


def sampling_defaults(generation_config: dict | None) -> dict[str, Any]:
    """The sampling values a file's generation_config sets (bad ones are ignored: requests may still set them)."""
    out: dict[str, Any] = {}
    for name in GENERATION_DEFAULTS:
        value = (generation_config or {}).get(name)
        if value is not None and not isinstance(value, bool) and isinstance(value, (int, float)):
            out[name] = value
    try:
        check_sampling(**{"temperature": 1.0, "top_p": 1.0, **out})
    except ColibriFormatError:
        return {}
    return out


@dataclass
class ParsedRequest:
    kind: str                           # "completion" | "chat"
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False


# --- bodies ---------------------------------------------------------------------------------------------------
def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body, or a 400."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    except ValueError as exc:             # JSONDecodeError, bad UTF-8, NaN / Infinity
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(body).__name__}")
    return body


def parse_completion(body: dict[str, Any], info: ModelInfo) -> ParsedRequest:
    """/v1/completions: the prompt as token ids and the sampling values, or an ApiError."""
    _neutral(body)
    ids = _prompt_ids(body.get("prompt"), info)
    return _request("completion", body, info, ids, DEFAULT_COMPLETION_TOKENS, info.stop_ids)


def parse_chat(body: dict[str, Any], info: ModelInfo) -> ParsedRequest:
    """/v1/chat/completions: the messages through the file's chat template, or an ApiError."""
    _neutral(body)
    messages = _messages(body.get("messages"))
    if info.tokenizer is None:
        raise ApiError(400, "this model file embeds no tokenizer: chat needs one (use /v1/completions with token "
                            "ids)", param="messages")
    try:
        check_text_fits("".join(m["content"] for m in messages), info.tokenizer, info.max_seq_len, "messages",
                        "conversation")
        ids = info.tokenizer.encode_chat(messages)
    except ColibriFormatError as exc:
        raise library_error(exc, "messages") from None
    return _request("chat", body, info, ids, None, info.chat_stop_ids)


def _request(kind: str, body: dict[str, Any], info: ModelInfo, ids: list[int], default_max: int | None,
             stop_ids: tuple[int, ...]) -> ParsedRequest:
    if not ids:
        raise ApiError(400, "the prompt holds no tokens", param="prompt" if kind == "completion" else "messages")
    room = info.max_seq_len - len(ids)
    if room < 1:
        raise ApiError(400, f"the prompt takes {len(ids)} tokens; this server's context is {info.max_seq_len} "
                            "tokens (prompt + max_tokens)", param="prompt" if kind == "completion" else "messages",
                       code="context_length_exceeded")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(name)
    if max_tokens is None:
        max_tokens = room if default_max is None else min(default_max, room)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ApiError(400, f"{name} must be an integer >= 1", param=name)
    if len(ids) + max_tokens > info.max_seq_len:
        raise ApiError(400, f"the prompt ({len(ids)} tokens) + {name} ({max_tokens}) = {len(ids) + max_tokens} "
                            f"tokens is over this server's context of {info.max_seq_len} tokens", param=name,
                       code="context_length_exceeded")
    sampling = {k: body[k] if body.get(k) is not None else info.defaults.get(k, d)
                for k, d in (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
                             ("repetition_penalty", 1.0))}
    if sampling["top_k"] == -1:           # vLLM's spelling of "off"
        sampling["top_k"] = 0
    try:
        check_sampling(**sampling)
    except ColibriFormatError as exc:
        raise library_error(exc) from None
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ApiError(400, "seed must be an integer >= 0", param="seed")
    stop = _stop(body.get("stop"), info)
    if _flag(body, "ignore_eos"):
        stop_ids = ()
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise ApiError(400, "stream_options must be an object, and only with stream: true", param="stream_options")
    include_usage = _flag(options or {}, "include_usage", "stream_options.include_usage")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string", param="model")
    params = SamplingParams(max_tokens=max_tokens, temperature=float(sampling["temperature"]),
                            top_p=float(sampling["top_p"]), top_k=int(sampling["top_k"]),
                            min_p=float(sampling["min_p"]), repetition_penalty=float(sampling["repetition_penalty"]),
                            seed=seed, stop=stop, stop_ids=tuple(stop_ids))
    return ParsedRequest(kind, model or info.id, list(ids), params, stream, include_usage,
                         _flag(body, "return_token_ids"))


def _flag(body: dict[str, Any], name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{param or name} must be true or false", param=param or name)
    return value


def _neutral(body: dict[str, Any]) -> None:
    for name, allowed in NEUTRAL.items():
        value = body.get(name)
        if any(value == a and type(value) is type(a) for a in allowed) or value in ({}, []) or value is None:
            continue
        if name == "response_format" and isinstance(value, dict) and value.get("type") == "text":
            continue
        raise ApiError(400, f"{name}={json.dumps(value)[:40]} is not supported by colibri serve", param=name,
                       code="unsupported_parameter")


def _prompt_ids(prompt: Any, info: ModelInfo) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                # a batch of one prompt
    if isinstance(prompt, str):
        if info.tokenizer is None:
            raise ApiError(400, "this model file embeds no tokenizer: give the prompt as token ids", param="prompt")
        _text(prompt, "prompt")
        try:
            check_text_fits(prompt, info.tokenizer, info.max_seq_len)
        except ColibriFormatError as exc:
            raise library_error(exc, "prompt") from None
        return info.tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        try:
            return check_ids(prompt, info.vocab_size, info.max_seq_len).tolist()
        except ColibriFormatError as exc:
            raise library_error(exc, "prompt") from None
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, "one prompt per request (send several requests: they are batched)", param="prompt")
    raise ApiError(400, "prompt must be a string or a list of token ids", param="prompt")


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}",
                           param=f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content parts must be text parts ({{\"type\": \"text\", "
                                    f"\"text\": ...}})", param=f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        elif content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be text", param=f"messages[{i}].content")
        _text(content, f"messages[{i}].content")
        out.append({"role": CHAT_ROLES[role], "content": content})
    return out


def _text(text: str, param: str) -> None:
    """Refuse text that is not valid UTF-8 (JSON lets a lone surrogate through: "\\ud800")."""
    try:
        utf8_text(text, param)
    except ColibriFormatError as exc:
        raise library_error(exc, param) from None


def _stop(stop: Any, info: ModelInfo) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    try:
        strings = check_stop_strings(stops)
    except ColibriFormatError as exc:
        raise ApiError(400, str(exc).replace("stop_strings", "stop"), param="stop") from None
    if strings and info.tokenizer is None:
        raise ApiError(400, "stop strings need a tokenizer, and this model file embeds none", param="stop")
    return strings


# --- responses ------------------------------------------------------------------------------------------------
class Reply:
    """The response objects of one request: a whole completion, or its stream of chunks."""

    def __init__(self, req: ParsedRequest) -> None:
        self.req = req
        self.chat = req.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"

    def usage(self, prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.req.model}

    def whole(self, text: str, finish_reason: str, token_ids: list[int], usage: dict[str, int]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=finish_reason)
        if self.req.return_token_ids:
            choice["token_ids"] = token_ids
        return {**self._head(self.object), "choices": [choice], "usage": usage}

    def chunk(self, text: str | None, token_ids: list[int] | None = None, finish_reason: str | None = None,
              role: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice.update(logprobs=None, finish_reason=finish_reason)
        if self.req.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        out = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if self.req.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage}


def sse(obj: Any) -> bytes:
    """One server-sent event carrying `obj` as JSON (or the literal [DONE])."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, allow_nan=False)
    return f"data: {data}\n\n".encode()
