"""The engine that runs a `.colibri` file: one decoder (forward.py) on the NumPy backend (device="cpu") or the CUDA
backend (device="cuda"); the expert pool, the cache wing (cache/), the CUDA wing (cuda/) and expert parallelism
(parallel/)."""

from colibri_format.runtime.engine import (Engine, EngineConfig, GenerationResult, GenerationStats, colibri_free,
                                           colibri_infer, colibri_init)

__all__ = ["Engine", "EngineConfig", "GenerationResult", "GenerationStats",
           "colibri_init", "colibri_infer", "colibri_free"]
