"""`colibri serve` over HTTP on 127.0.0.1, driven by the official `openai` client (and httpx for what a client
library would not send): completions and chat, whole and streamed, stop strings, concurrent clients equal to the
same requests one at a time, cancellation by closing a stream or dropping a connection, and the errors: 400 for
malformed JSON, bad fields and oversized requests, 429 beyond the queue, 404 for unknown paths; never a traceback."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from colibri_format.runtime import EngineConfig  # noqa: E402
from colibri_format.serve.server import BackgroundServer  # noqa: E402

PROMPTS = ["def fibonacci(n):\n    ", "import os\n", "class Stack:\n    def", "# compute the mean\n",
           "for i in range(", "x = [", "while True:\n"]


@pytest.fixture(scope="module")
def server(demo_file):
    with BackgroundServer(demo_file, EngineConfig(max_batch_size=4, max_seq_len=1024), max_queue=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def wait_for(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def complete(client, server, prompt: str, **kw):
    return client.completions.create(model=server.model, prompt=prompt, temperature=0, **kw)


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["colibri-demo-moe"]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok"
    assert health["decode"]["mode"] == "packed" and set(health["decode"]["graphs"]) <= {"1", "2", "4", "8"}
    text = httpx.get(server.url + "/metrics").text
    for name in ("colibri_generation_tokens_per_second", "colibri_queue_depth", "colibri_running_requests",
                 "colibri_expert_cache_hit_rate", "colibri_expert_paging_gb_per_second",
                 'colibri_requests_total{outcome="finished"}', "colibri_time_to_first_token_seconds_count"):
        assert f"\n{name}" in text, name


def test_completion_whole_and_streamed(server, client):
    whole = complete(client, server, PROMPTS[0], max_tokens=20, extra_body={"ignore_eos": True})
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.text.strip()
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == \
        (server.info.tokenizer.encode(PROMPTS[0]).__len__(), 20, whole.usage.prompt_tokens + 20)
    chunks = list(complete(client, server, PROMPTS[0], max_tokens=20, stream=True, extra_body={"ignore_eos": True},
                           stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 5             # streamed in pieces
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_chat_whole_and_streamed(server, client):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "a stack class"}]
    whole = client.chat.completions.create(model=server.model, messages=messages, max_tokens=16, temperature=0)
    reply = whole.choices[0].message
    assert reply.role == "assistant" and reply.content and whole.choices[0].finish_reason in ("stop", "length")
    prompt = server.info.tokenizer.encode_chat(messages)
    assert whole.usage.prompt_tokens == len(prompt)
    stream = client.chat.completions.create(model=server.model, messages=messages, max_tokens=16, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stop_strings(server, client):
    full = complete(client, server, PROMPTS[1], max_tokens=24, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 4]
    cut = complete(client, server, PROMPTS[1], max_tokens=24, stop=[stop, "never"]).choices[0]
    assert (cut.text, cut.finish_reason) == (full[:full.index(stop)], "stop")
    streamed = list(complete(client, server, PROMPTS[1], max_tokens=24, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut.text                  # nothing of the stop shown
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_concurrent_clients_get_their_one_at_a_time_outputs(server, client):
    lengths = [12 + 4 * i for i in range(len(PROMPTS))]       # 7 clients, 4 slots: some wait, all leave apart
    alone = [complete(client, server, p, max_tokens=n).choices[0].text for p, n in zip(PROMPTS, lengths)]
    before = server.scheduler.metrics.snapshot()
    together: dict[int, str] = {}
    start = threading.Barrier(len(PROMPTS))

    def one(i: int) -> None:
        start.wait()
        together[i] = complete(client, server, PROMPTS[i], max_tokens=lengths[i]).choices[0].text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    after = server.scheduler.metrics.snapshot()
    assert [together.get(i) for i in range(len(PROMPTS))] == alone
    rows, steps = after["decode_rows"] - before["decode_rows"], after["decode_steps"] - before["decode_steps"]
    assert rows / steps > 2                                   # they shared decode steps


def test_closing_a_stream_frees_the_slot(server, client):
    before = server.scheduler.metrics.snapshot()["outcomes"]["cancelled"]
    stream = complete(client, server, PROMPTS[2], max_tokens=1000, stream=True, extra_body={"ignore_eos": True})
    pieces = [next(iter(stream)) for _ in range(3)]
    assert pieces and server.scheduler.running == 1
    stream.close()
    assert wait_for(lambda: server.scheduler.running == 0, 5)
    assert server.scheduler.metrics.snapshot()["outcomes"]["cancelled"] == before + 1


def test_a_dropped_connection_frees_the_slot(server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"prompt": "import", "max_tokens": 1000, "ignore_eos": True},
                   timeout=httpx.Timeout(60, read=0.5))
    assert wait_for(lambda: server.scheduler.running == 0, 5)


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b'{"prompt": "x", "max_tokens": 10', None),
    (b'["prompt"]', None),
    (b'{"prompt": "x", "temperature": NaN}', None),
    (b'{"prompt": "x", "temperature": -1}', "temperature"),
    (b'{"prompt": "x", "n": 3}', "n"),
    (b'{"model": "m"}', "prompt"),
    (b'{"prompt": "x", "max_tokens": 2000}', "max_tokens"),                     # 1 + 2000 > 1024
    (b'{"prompt": [1, 2, 99999]}', "prompt"),
])
def test_bad_requests_get_a_400_json_error(server, body, param):
    response = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"] and "Traceback" not in response.text


def test_oversized_requests_through_the_client(server, client):
    with pytest.raises(openai.BadRequestError) as exc:
        complete(client, server, PROMPTS[0], max_tokens=1020)
    assert exc.value.status_code == 400 and exc.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "word " * 2000}])
    assert exc.value.code == "context_length_exceeded"


def test_unknown_paths_and_methods_are_json(server):
    missing = httpx.get(server.url + "/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    wrong = httpx.get(server.url + "/v1/completions")
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_429_beyond_the_queue(demo_file):
    with BackgroundServer(demo_file, EngineConfig(max_batch_size=1, max_seq_len=1024), max_queue=1) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        long = dict(model=srv.model, max_tokens=1000, temperature=0, stream=True, extra_body={"ignore_eos": True})
        running = client.completions.create(prompt="import os\n", **long)
        next(iter(running))                                                     # it holds the only slot
        queued = client.completions.create(prompt="x = [", **long)               # it waits
        assert wait_for(lambda: len(srv.scheduler.waiting) == 1)
        with pytest.raises(openai.RateLimitError) as exc:
            client.completions.create(model=srv.model, prompt="too many", max_tokens=2)
        assert exc.value.status_code == 429 and exc.value.response.json()["error"]["code"] == "rate_limit_exceeded"
        assert exc.value.response.headers["retry-after"] == "1"
        running.close()
        assert next(iter(queued)).choices[0].text is not None                   # the waiting one moved up
        queued.close()
        assert wait_for(lambda: srv.scheduler.running == 0, 5)
        assert 'colibri_requests_total{outcome="rejected_queue_full"} 1' in httpx.get(srv.url + "/metrics").text


def test_an_engine_fault_fails_the_request_not_the_server(demo_file, tmp_path):
    import shutil

    import colibri_format

    bad = tmp_path / "corrupt.colibri"
    shutil.copy(demo_file, bad)
    with colibri_format.open(bad, verify="never") as f:
        offsets = [f.blob_offset(0, e) for e in range(f.model["num_experts"])]
    with open(bad, "r+b") as fh:                           # every expert of layer 0: any prompt reaches one
        for offset in offsets:
            fh.seek(offset + 5)
            byte = fh.read(1)[0]
            fh.seek(offset + 5)
            fh.write(bytes([byte ^ 0x5A]))
    with BackgroundServer(str(bad), EngineConfig(max_batch_size=2, max_seq_len=256)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError) as exc:
            client.completions.create(model=srv.model, prompt="import os", max_tokens=4)
        error = exc.value.response.json()["error"]
        assert error["type"] == "server_error" and "checksum" in error["message"].lower()
        with pytest.raises(openai.APIError, match="checksum"):                     # streamed: an error event
            list(client.completions.create(model=srv.model, prompt="x", max_tokens=4, stream=True))
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"             # the server goes on
        assert 'colibri_requests_total{outcome="failed"} 2' in httpx.get(srv.url + "/metrics").text
