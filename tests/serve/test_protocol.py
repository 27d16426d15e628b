"""The OpenAI wire format without a server: request bodies checked into a prompt and sampling values, every
refusal an ApiError with an OpenAI-style body (400, the offending field as `param`), the response objects."""

from __future__ import annotations

import json

import pytest

import colibri_format
from colibri_format.runtime.infer import chat_stop_ids
from colibri_format.runtime.tokenizer import Tokenizer
from colibri_format.serve.protocol import (ApiError, ModelInfo, Reply, parse_body, parse_chat, parse_completion,
                                           sampling_defaults, sse)


@pytest.fixture(scope="module")
def info(demo_file):
    with colibri_format.open(demo_file) as f:
        tok = Tokenizer.from_metadata(f.metadata)
    return ModelInfo("demo", tok, 4096, 64, stop_ids=tuple(tok.stop_ids), chat_stop_ids=tuple(chat_stop_ids(tok)))


def refused(parse, body, info, param, status=400, code=None):
    with pytest.raises(ApiError) as exc:
        parse(body, info)
    e = exc.value
    assert (e.status, e.param) == (status, param), e.message
    if code is not None:
        assert e.code == code
    assert set(e.body()["error"]) == {"message", "type", "param", "code"} and e.message
    return e


@pytest.mark.parametrize("raw", [b"{bad", b"", b"[1, 2]", b'"text"', b'{"a": NaN}', b"\xff\xfe{}", b"[" * 100_000])
def test_bodies_that_are_not_a_json_object(raw):
    with pytest.raises(ApiError) as exc:
        parse_body(raw)
    assert exc.value.status == 400 and exc.value.type == "invalid_request_error"


def test_a_completion_request(info):
    req = parse_completion({"model": "m", "prompt": "def f(x):", "max_tokens": 5, "temperature": 0, "top_p": 0.5,
                            "top_k": 4, "min_p": 0.1, "seed": 3, "stop": "\n"}, info)
    assert req.prompt_ids == info.tokenizer.encode("def f(x):") and req.model == "m" and not req.stream
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.stop) == (5, 0.0, 0.5, 4, 0.1, 3, ("\n",))
    assert p.stop_ids == tuple(info.tokenizer.stop_ids) and p.greedy


def test_defaults_are_openai_s(info):
    req = parse_completion({"prompt": [5, 6, 7]}, info)
    assert req.prompt_ids == [5, 6, 7] and req.model == "demo"
    assert (req.params.max_tokens, req.params.temperature, req.params.top_p) == (16, 1.0, 1.0)
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, info)
    assert chat.params.max_tokens == 64 - len(chat.prompt_ids)          # the rest of the context
    assert sampling_defaults({"temperature": 0.6, "top_k": 20, "do_sample": True}) == {"temperature": 0.6, "top_k": 20}
    assert sampling_defaults({"temperature": -1}) == {}                  # a bad file value is no default


def test_chat_goes_through_the_embedded_template(info):
    req = parse_chat({"messages": [{"role": "developer", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "hel"},
                                                                {"type": "text", "text": "lo"}]}],
                      "max_completion_tokens": 4, "ignore_eos": True}, info)
    text = info.tokenizer.decode(req.prompt_ids, skip_special_tokens=False)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert req.params.max_tokens == 4 and req.params.stop_ids == ()
    assert set(info.chat_stop_ids) > set(info.stop_ids)                 # <|im_end|> ends a chat turn


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"),
    ({"prompt": 3}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, 5000]}, "prompt"),                    # a token id outside the vocabulary
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": "\ud800"}, "prompt"),                     # a lone surrogate is not UTF-8 text
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": 2.5}, "top_k"),
    ({"prompt": "x", "min_p": 2}, "min_p"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "stop": ""}, "stop"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "stop": ["s"] * 65}, "stop"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),    # without stream
    ({"prompt": "x", "model": 7}, "model"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "logprobs": 3}, "logprobs"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "x", "logit_bias": {"5": 10}}, "logit_bias"),
])
def test_bad_completion_fields(info, body, param):
    refused(parse_completion, body, info, param)


def test_neutral_values_of_unsupported_fields_pass(info):
    req = parse_completion({"prompt": "x", "n": 1, "logprobs": None, "echo": False, "presence_penalty": 0,
                            "frequency_penalty": 0.0, "logit_bias": {}, "user": "u", "top_k": -1}, info)
    assert req.params.top_k == 0


@pytest.mark.parametrize("messages, param", [
    (None, "messages"), ([], "messages"), (["hi"], "messages[0]"),
    ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content"),
    ([{"role": "user"}], "messages[0].content"),
])
def test_bad_messages(info, messages, param):
    refused(parse_chat, {"messages": messages}, info, param)


def test_context_length(info):
    e = refused(parse_completion, {"prompt": [1] * 60, "max_tokens": 5}, info, "max_tokens",
                code="context_length_exceeded")
    assert "60" in e.message and "64" in e.message
    parse_completion({"prompt": [1] * 60, "max_tokens": 4}, info)           # exactly the context
    refused(parse_completion, {"prompt": [1] * 64}, info, "prompt", code="context_length_exceeded")
    refused(parse_completion, {"prompt": "word " * 5000}, info, "prompt", code="context_length_exceeded")
    refused(parse_chat, {"messages": [{"role": "user", "content": "word " * 100}]}, info, "messages",
            code="context_length_exceeded")


def test_no_tokenizer(info):
    bare = ModelInfo("bare", None, 100, 64)
    assert parse_completion({"prompt": [1, 2]}, bare).params.stop_ids == ()
    refused(parse_completion, {"prompt": "text"}, bare, "prompt")
    refused(parse_completion, {"prompt": [1, 2], "stop": "x"}, bare, "stop")
    refused(parse_chat, {"messages": [{"role": "user", "content": "x"}]}, bare, "messages")


def test_response_objects(info):
    req = parse_chat({"messages": [{"role": "user", "content": "x"}], "stream": True,
                      "stream_options": {"include_usage": True}, "return_token_ids": True}, info)
    reply = Reply(req)
    first = reply.chunk("", role=True)
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {"role": "assistant",
                                                                                          "content": ""}
    last = reply.chunk(None, finish_reason="stop")
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop" and last["usage"] is None
    usage = reply.usage_chunk(reply.usage(3, 4))
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    whole = reply.whole("hi", "length", [5, 6], reply.usage(3, 2))
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"] == {"role": "assistant",
                                                                                       "content": "hi"}
    assert whole["choices"][0]["token_ids"] == [5, 6] and whole["id"].startswith("chatcmpl-")
    assert sse({"a": "é"}) == 'data: {"a": "é"}\n\n'.encode() and sse("[DONE]") == b"data: [DONE]\n\n"
    assert json.loads(sse(whole)[6:])["usage"]["total_tokens"] == 5
