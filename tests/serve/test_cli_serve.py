"""`colibri serve` as a command: --help, the options reaching the engine and the server, one error line for a
missing package or a bad file, and the real command answering a request on 127.0.0.1 until Ctrl-C (exit 130 with
the interrupt line, as every command)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from colibri_format.cli import main
from tests.subprocesses import default_sigint


def test_help(capsys):
    assert main(["serve", "--help"]) == 0
    text = capsys.readouterr().out
    for option in ("--host", "--port", "--device", "--max-batch-size", "--max-queue", "--max-seq-len", "--gpu-memory"):
        assert option in text


def test_options_reach_the_engine_and_the_server(monkeypatch, demo_file):
    from colibri_format.serve import server

    calls = []
    monkeypatch.setattr(server, "serve", lambda *a, **k: calls.append((a, k)))
    assert main(["serve", demo_file, "--host", "0.0.0.0", "--port", "9123", "--max-batch-size", "3",
                 "--max-queue", "5", "--max-seq-len", "512", "--max-cached-experts", "20"]) == 0
    (path, config), kwargs = calls[0]
    assert path == demo_file
    assert (config.device, config.max_batch_size, config.max_seq_len, config.max_cached_experts) == ("cpu", 3, 512, 20)
    assert {k: kwargs[k] for k in ("host", "port", "max_queue")} == {"host": "0.0.0.0", "port": 9123, "max_queue": 5}


def test_gpu_memory(monkeypatch, demo_file, capsys):
    from colibri_format.serve import server

    calls = []
    monkeypatch.setattr(server, "serve", lambda *a, **k: calls.append(a))
    assert main(["serve", demo_file, "--gpu-memory", "2GiB"]) == 0 and calls[0][1].gpu_memory == 2 << 30
    assert main(["serve", demo_file, "--gpu-memory", "lots"]) == 2 or "gpu_memory" in capsys.readouterr().err


def test_activation_switch(monkeypatch, demo_file):
    from colibri_format.serve import server

    calls = []
    monkeypatch.setattr(server, "serve", lambda *a, **k: calls.append(a))
    assert main(["serve", demo_file]) == 0 and calls[-1][1].int8_activations is True
    assert main(["serve", demo_file, "--float-activations"]) == 0 and calls[-1][1].int8_activations is False


def test_kv_cache_dtype(monkeypatch, demo_file, capsys):
    from colibri_format.serve import server

    calls = []
    monkeypatch.setattr(server, "serve", lambda *a, **k: calls.append(a))
    assert main(["serve", demo_file]) == 0 and calls[-1][1].kv_cache_dtype == "auto"
    assert main(["serve", demo_file, "--kv-cache-dtype", "bfloat16"]) == 0
    assert calls[-1][1].kv_cache_dtype == "bfloat16"
    assert main(["serve", demo_file, "--kv-cache-dtype", "int4"]) == 2 and len(calls) == 2
    assert "--kv-cache-dtype" in capsys.readouterr().err


@pytest.mark.parametrize("missing", [("fastapi",), ("uvicorn",), ("fastapi", "uvicorn")])
def test_missing_packages_are_one_line(monkeypatch, capsys, demo_file, missing):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a))
    assert main(["serve", demo_file]) == 1
    err = capsys.readouterr().err
    assert f"needs {' and '.join(missing)}" in err and "pip install 'colibri-format[serve]'" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_bad_file_is_one_error_line(tmp_path, capsys):
    bad = tmp_path / "bad.colibri"
    bad.write_bytes(b"not a colibri file" * 100)
    assert main(["serve", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_command_serves_until_ctrl_c(demo_file):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "colibri_format", "serve", demo_file, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=default_sigint)   # the Ctrl-C reaches it even if this run ignores SIGINT
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.1)
        body = {"model": "colibri-demo-moe", "prompt": "def add(a, b):\n    return", "max_tokens": 8,
                "temperature": 0}
        answer = httpx.post(url + "/v1/completions", content=json.dumps(body), timeout=30).json()
        assert answer["usage"]["completion_tokens"] <= 8 and answer["choices"][0]["text"]
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err                       # Ctrl-C: uvicorn's graceful shutdown, then the CLI's
    assert err.strip().splitlines()[-1] == "interrupted: the server stopped; nothing was written"    # one line
    assert f"serving colibri-demo-moe at http://127.0.0.1:{port}/v1" in err and "Traceback" not in err
