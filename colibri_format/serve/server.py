"""`colibri serve` put together: the scheduler (which opens the engine), the app and uvicorn, in the foreground
(`serve`, what the command runs) or on a background thread (`BackgroundServer`: tests and benchmarks).

    with BackgroundServer("model.colibri", EngineConfig(max_batch_size=8)) as server:
        openai.OpenAI(base_url=server.url + "/v1", api_key="-").completions.create(model=server.model, prompt="hi")
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

from colibri_format.runtime.engine import EngineConfig
from colibri_format.runtime.infer import chat_stop_ids

from .protocol import ModelInfo, sampling_defaults
from .scheduler import Scheduler

STARTUP_SECONDS = 60.0


def model_info(scheduler: Scheduler, path: str, model_id: str | None = None) -> ModelInfo:
    """The served model's card and request limits, from the started scheduler's engine."""
    tok = scheduler.tokenizer
    return ModelInfo(id=model_id or Path(path).stem, tokenizer=tok, vocab_size=scheduler.vocab_size,
                     max_seq_len=scheduler.max_seq_len, created=int(os.stat(path).st_mtime),
                     stop_ids=tuple(tok.stop_ids) if tok is not None else (),
                     chat_stop_ids=tuple(chat_stop_ids(tok)) if tok is not None else (),
                     defaults=sampling_defaults(tok.generation_config) if tok is not None else {})


def open_app(path: str, config: EngineConfig, *, max_queue: int = 64, prefill_tokens: int = 2048,
             decode: str = "auto", model_id: str | None = None) -> tuple[Scheduler, Any, ModelInfo]:
    """Start a scheduler over `path` (the engine opens on its thread; its errors are raised here) and build the
    app; the caller closes the scheduler."""
    from .app import create_app

    scheduler = Scheduler(path, config, max_queue=max_queue, prefill_tokens=prefill_tokens, decode=decode).start()
    try:
        info = model_info(scheduler, str(path), model_id)
        return scheduler, create_app(scheduler, info), info
    except BaseException:
        scheduler.close()
        raise


def serve(path: str, config: EngineConfig, *, host: str = "127.0.0.1", port: int = 8000,
          announce: Callable[[Scheduler, ModelInfo, str], None] | None = None, log_level: str = "info",
          **options: Any) -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM: uvicorn's graceful shutdown, then the engine closes)."""
    import uvicorn

    scheduler, app, info = open_app(path, config, **options)
    try:
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                                               timeout_graceful_shutdown=5))
        if announce is not None:
            announce(scheduler, info, f"http://{host if ':' not in host else f'[{host}]'}:{port}")
        server.run()
    finally:
        scheduler.close()


class BackgroundServer:
    """The server on 127.0.0.1 (a free port by default) on a daemon thread; `url`, `model`, `scheduler`."""

    def __init__(self, path: str, config: EngineConfig, *, host: str = "127.0.0.1", port: int = 0,
                 **options: Any) -> None:
        self.path, self.config, self.host, self.port, self.options = str(path), config, host, port, options
        self.scheduler: Scheduler | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "BackgroundServer":
        import uvicorn

        self.scheduler, app, self.info = open_app(self.path, self.config, **self.options)
        self.model = self.info.id
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            self.port = sock.getsockname()[1]
            self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                                         timeout_graceful_shutdown=2))
            self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                            name="colibri-serve-http", daemon=True)
            self._thread.start()
            deadline = time.monotonic() + STARTUP_SECONDS
            while not self._server.started:
                if not self._thread.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError("the HTTP server did not start")
                time.sleep(0.01)
        except BaseException:
            self.close()
            sock.close()
            raise
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        if self.scheduler is not None:
            self.scheduler.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()
