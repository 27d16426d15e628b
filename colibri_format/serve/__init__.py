"""`colibri serve`: an OpenAI-compatible HTTP server with continuous batching over one engine.

- `scheduler`: the serving loop (one thread owns the engine; requests join and leave a batch of slots between
  decode steps); no web stack.
- `protocol`: the OpenAI wire format (request checks, response objects, errors); no web stack.
- `metrics`: the Prometheus text of `/metrics`.
- `app`: the FastAPI app; `server`: the app, the scheduler and uvicorn together (the command, tests, benchmarks).

fastapi and uvicorn (the `serve` extra) are imported by `app` and `server` only, so importing this package, the
scheduler or the protocol needs neither. See docs/serve.md.
"""
