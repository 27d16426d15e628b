"""Load on `colibri serve` over loopback: throughput and time to first token at 1, 8 and 32 concurrent clients.

    PYTHONPATH=. python benchmarks/serve_load.py --device cpu                  # the bundled demo model
    PYTHONPATH=. python benchmarks/serve_load.py --device cuda --qwen3-30b /dev/shm/qwen3_30b_a3b.colibri \\
        --cache all,50% --json serve_load_h200.json

The server is the real command (`python -m colibri_format serve FILE --port P ...`) in a child process on
127.0.0.1; the clients are asyncio tasks of this process over httpx. Every request streams (`stream: true`,
`return_token_ids: true`, `ignore_eos: true`, greedy), so it generates exactly --max-tokens tokens and each token
arrives as its own event. Prompts are seeded random token ids (--prompt-tokens each), so a file without a
tokenizer works the same. At each level, N clients send --requests-per-client requests each, back to back (a
closed loop); one warm-up request runs before the first level.

Per level: throughput = completion tokens / wall time of the level; time to first token (TTFT) = from sending a
request to its first token event, median and p90; per-request decode tokens/s after the first token (median);
mean decode batch = running requests per decode step, from the server's /metrics (as are the rows each step ran:
its batch bucket, the share of steps that replayed a CUDA graph, the expert cache hit rate and the paging GB/s, for
`--cache` below 100%).

--file: a .colibri file (default: the bundled models/colibri-demo-moe, converted to /tmp once).
--qwen3-30b PATH: a full-depth Qwen3-30B-A3B-shaped synthetic file (48 layers, 128 experts top-8, hidden 2048,
  vocabulary 151,936; random weights, one expert blob repeated: ~30 GB), written to PATH when it is not there.
--cache all,50%: one server per value (`--max-cached-experts`: a count, a share of all experts, or all).
--blas-threads N: OPENBLAS_NUM_THREADS of the server (the CPU engine). On a small machine a multi-threaded BLAS
  fights the server's HTTP thread and the clients for the cores: compare the default with --blas-threads 1.
Bounded: each level stops after --timeout seconds (the requests left are counted as not finished).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "colibri-demo-moe"
DEMO_FILE = Path("/tmp/colibri_serve_load_demo.colibri")
SETTLE = 1.5          # seconds: more than the server's engine-stats interval (serve/scheduler.py)
QWEN3_30B = dict(vocab=151936, hidden=2048, layers=48, heads=32, kv_heads=4, experts=128, top_k=8,
                 expert_inter=768, qk_norm="per_head")


def log(msg: str) -> None:
    print(f"[serve_load {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- the model file --------------------------------------------------------------------------------------------
def demo_file() -> Path:
    if not DEMO_FILE.exists():
        log(f"converting {DEMO} -> {DEMO_FILE}")
        subprocess.run([sys.executable, "-m", "colibri_format", "convert", "--model-path", str(DEMO),
                        "--output-path", str(DEMO_FILE), "--quiet"], check=True, cwd=ROOT, env=child_env())
    return DEMO_FILE


def qwen3_30b_file(path: Path) -> Path:
    """Write the full-depth Qwen3-30B-A3B-shaped synthetic file at `path` unless it is there."""
    if path.exists():
        return path
    from colibri_format import spec as S
    from colibri_format.synthetic import synthetic_model, write_synthetic

    model = synthetic_model(**QWEN3_30B)
    model["head_dim"] = 128
    model["max_position_embeddings"] = 4096
    log(f"writing a Qwen3-30B-A3B-shaped synthetic file to {path} (~30 GB)")
    t0 = time.perf_counter()
    write_synthetic(path, model, reuse_expert=True, dense_dtype=S.DType.BF16)
    log(f"written in {time.perf_counter() - t0:.0f} s ({path.stat().st_size / 1e9:.1f} GB)")
    return path


def cache_capacity(path: Path, value: str) -> int | None:
    """--max-cached-experts for `value`: None for all, a count, or a share ('50%') of all experts."""
    if value in ("all", "100%"):
        return None
    if value.endswith("%"):
        import colibri_format

        with colibri_format.open(path) as f:
            total = len(f.model["moe_layers"]) * f.model["num_experts"]
        return max(1, round(total * float(value[:-1]) / 100))
    return int(value)


# --- the server ------------------------------------------------------------------------------------------------
def child_env(blas_threads: int | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONUNBUFFERED": "1"}
    if blas_threads is not None:
        env.update(OPENBLAS_NUM_THREADS=str(blas_threads), OMP_NUM_THREADS=str(blas_threads),
                   MKL_NUM_THREADS=str(blas_threads))
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`colibri serve` in a child process; its output goes to a log file."""

    def __init__(self, path: Path, args: argparse.Namespace, capacity: int | None, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "colibri_format", "serve", str(path), "--port", str(self.port),
               "--device", args.device, "--max-batch-size", str(args.max_batch_size),
               "--max-queue", str(max(args.levels) * 2), "--max-seq-len", str(args.prompt_tokens + args.max_tokens)]
        if capacity is not None:
            cmd += ["--max-cached-experts", str(capacity)]
        prefix = f"OPENBLAS_NUM_THREADS={args.blas_threads} " if args.blas_threads is not None else ""
        self.command = prefix + "colibri " + " ".join(cmd[3:])
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env=child_env(args.blas_threads))

    def wait_ready(self, seconds: float) -> None:
        import httpx

        deadline = time.monotonic() + seconds
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start in {seconds:.0f} s; see {self.log.name}")
            time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        import httpx

        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            m = re.match(r"^(colibri_[a-z_]+(?:\{[^}]*\})?) (\S+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# --- the clients -----------------------------------------------------------------------------------------------
async def one_request(client, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    t0 = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"error": f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"}
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            event = json.loads(line[6:])
            if "error" in event:
                return {"error": event["error"]["message"]}
            ids = event["choices"][0].get("token_ids") or [] if event["choices"] else []
            if ids and first is None:
                first = time.perf_counter()
            tokens += len(ids)
    end = time.perf_counter()
    if first is None:
        return {"error": "no token"}
    return {"ttft": first - t0, "tokens": tokens, "latency": end - t0,
            "decode_tps": (tokens - 1) / (end - first) if tokens > 1 and end > first else 0.0}


async def run_level(url: str, clients: int, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    import httpx

    results: list[dict] = []
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        async def worker(c: int) -> None:
            for r in range(args.requests_per_client):
                prompt = prompts[(c * args.requests_per_client + r) % len(prompts)]
                results.append(await one_request(client, url, prompt, args.max_tokens))

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(worker(c)) for c in range(clients)]
        done, pending = await asyncio.wait(tasks, timeout=args.timeout)
        for task in pending:
            task.cancel()
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    ttft = sorted(r["ttft"] for r in ok)
    return {"clients": clients, "requests": len(ok), "errors": len(errors),
            "first_error": errors[0] if errors else None,
            "unfinished": clients * args.requests_per_client - len(results), "wall_s": wall,
            "tokens": sum(r["tokens"] for r in ok), "throughput_tok_s": sum(r["tokens"] for r in ok) / wall,
            "ttft_median_s": statistics.median(ttft) if ttft else None,
            "ttft_p90_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))] if ttft else None,
            "decode_tok_s_per_request": statistics.median(r["decode_tps"] for r in ok) if ok else None}


def level_metrics(before: dict[str, float], after: dict[str, float]) -> dict:
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps = delta("colibri_decode_steps_total")
    hits, misses = delta("colibri_expert_cache_hits_total"), delta("colibri_expert_cache_misses_total")
    buckets = {int(m.group(1)): delta(k) for k in after
               if (m := re.fullmatch(r'colibri_decode_batch_steps_total\{batch="(\d+)"\}', k))}
    graph = delta('colibri_decode_steps_by_form_total{form="graph"}')
    return {"mean_decode_batch": delta("colibri_decode_rows_total") / steps if steps else 0.0,
            "mean_step_rows": sum(b * n for b, n in buckets.items()) / steps if steps else 0.0,
            "graph_step_share": graph / steps if steps else 0.0,
            "batch_steps": {b: int(n) for b, n in sorted(buckets.items()) if n},
            "expert_hit_rate": hits / (hits + misses) if hits + misses else None,
            "paged_gb": delta("colibri_expert_bytes_paged_total") / 1e9}


# --- the report ------------------------------------------------------------------------------------------------
def machine() -> str:
    parts = [platform.node() or "?", f"{os.cpu_count()} CPUs", platform.processor() or platform.machine()]
    if shutil.which("nvidia-smi"):
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip().splitlines()
        parts += gpu[:1]
    return ", ".join(parts)


def table(rows: list[dict]) -> str:
    head = ("| cache | clients | requests | tokens | wall s | throughput tok/s | TTFT median s | TTFT p90 s | "
            "decode tok/s per request | mean decode batch | rows run per step | graph steps | expert hit rate | "
            "paged GB |")
    lines = [head, "| " + " | ".join(["---"] + ["---:"] * 13) + " |"]
    for r in rows:
        hit = "-" if r["expert_hit_rate"] is None else f"{100 * r['expert_hit_rate']:.1f}%"
        short = f" ({r['errors']} failed, {r['unfinished']} unfinished)" if r["errors"] or r["unfinished"] else ""
        lines.append(f"| {r['cache']} | {r['clients']} | {r['requests']}{short}"
                     f" | {r['tokens']} | {r['wall_s']:.2f} | {r['throughput_tok_s']:.1f} | "
                     f"{_s(r['ttft_median_s'])} | {_s(r['ttft_p90_s'])} | {_f(r['decode_tok_s_per_request'])} | "
                     f"{r['mean_decode_batch']:.2f} | {r.get('mean_step_rows', 0.0):.2f} | "
                     f"{100 * r.get('graph_step_share', 0.0):.0f}% | {hit} | {r['paged_gb']:.2f} |")
    return "\n".join(lines)


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--file", type=Path, help="a .colibri file (default: the bundled demo model)")
    ap.add_argument("--qwen3-30b", type=Path, metavar="PATH",
                    help="use (and first write, if missing) a Qwen3-30B-A3B-shaped synthetic file at PATH")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--clients", default="1,8,32", help="concurrency levels")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch-size", type=int, default=None, help="server slots (default: the largest level)")
    ap.add_argument("--cache", default="all", help="--max-cached-experts per server: all, N or P%%; comma list")
    ap.add_argument("--blas-threads", type=int, default=None,
                    help="OPENBLAS_NUM_THREADS (and OMP/MKL) of the server process (default: inherited)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per level at most")
    ap.add_argument("--startup", type=float, default=900.0, help="seconds the server may take to open the file")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp"), help="where each server's log goes")
    args = ap.parse_args()
    args.levels = [int(c) for c in args.clients.split(",")]
    args.max_batch_size = args.max_batch_size or max(args.levels)
    path = qwen3_30b_file(args.qwen3_30b) if args.qwen3_30b else (args.file or demo_file())
    import colibri_format

    with colibri_format.open(path) as f:
        vocab = f.model["vocab_size"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, args.prompt_tokens).tolist() for _ in range(64)]
    started = datetime.datetime.now(datetime.timezone.utc)
    rows, commands = [], []
    for cache in args.cache.split(","):
        capacity = cache_capacity(path, cache)
        server = Server(path, args, capacity, args.log_dir / f"colibri_serve_load_{cache.replace('%', 'pct')}.log")
        commands.append(server.command)
        try:
            t0 = time.perf_counter()
            server.wait_ready(args.startup)
            log(f"server up in {time.perf_counter() - t0:.1f} s: {server.command}")
            asyncio.run(run_level(server.url, 1, argparse.Namespace(**{**vars(args), "requests_per_client": 1}),
                                  prompts[-1:]))                                  # warm-up
            for clients in args.levels:
                time.sleep(SETTLE)                  # the server's engine snapshot is taken once it is idle
                before = server.metrics()
                row = asyncio.run(run_level(server.url, clients, args, prompts))
                time.sleep(SETTLE)
                row.update(level_metrics(before, server.metrics()), cache=cache if capacity is None
                           else f"{cache} ({capacity} experts)")
                log(f"cache {cache}, {clients} clients: {row['throughput_tok_s']:.1f} tok/s, "
                    f"TTFT median {_s(row['ttft_median_s'])} s")
                rows.append(row)
        finally:
            server.stop()
    print(f"date: {started:%Y-%m-%d %H:%M} UTC; machine: {machine()}; file: {path} "
          f"({path.stat().st_size / 1e9:.2f} GB); device {args.device}")
    print(f"command: PYTHONPATH=. python benchmarks/serve_load.py {' '.join(sys.argv[1:])}")
    for c in commands:
        print(f"server: {c}")
    print(f"load: levels {args.clients} clients x {args.requests_per_client} requests, {args.prompt_tokens} prompt "
          f"tokens, {args.max_tokens} generated tokens each (greedy, ignore_eos, streamed)\n")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"date": started.isoformat(), "machine": machine(), "file": str(path),
                                         "device": args.device, "servers": commands, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
