"""`colibri infer` inside one rank of an expert-parallel group: the run_infer contract, printed by rank 0."""

from __future__ import annotations

import os
from typing import Any, Callable

from colibri_format.runtime import EngineConfig
from colibri_format.runtime.infer import prompt_token_ids, text_streamer
from colibri_format.runtime.parallel import dist as pdist


def run_infer_parallel(path: str | os.PathLike, prompt: str | None = None, *, ids: list[int] | None = None,
                       chat: bool = False, max_new_tokens: int = 32, temperature: float = 0.0,
                       top_p: float = 1.0, seed: int | None = None, stream: Callable[[str], Any] | None = None,
                       **config: Any) -> dict[str, Any] | None:
    """This rank's part of `run_infer`: the same dict on rank 0, None elsewhere (only rank 0 prints)."""
    from colibri_format.runtime.parallel.engine import ExpertParallelEngine

    me = pdist.init_from_env()
    config.pop("device", None)                    # the rank's torch device comes from the launcher
    try:
        with ExpertParallelEngine(path, EngineConfig(**config), device=me.device) as engine:
            prompt_ids = prompt_token_ids(engine, prompt, ids, chat)
            on_token = text_streamer(engine, stream) if me.rank == 0 else None
            result = engine.generate(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                     top_p=top_p, seed=seed, callback=on_token)
    finally:
        pdist.shutdown()
    if me.rank != 0:
        return None
    if on_token is not None:
        on_token.finish(result.text)              # what the stream still held back (a partial character)
    stats = result.stats.as_dict()
    stats["world_size"] = me.world_size
    return {"prompt_ids": prompt_ids, "output_ids": result.output_ids, "text": result.text,
            "finish_reason": stats.pop("finish_reason"), "stats": stats}
