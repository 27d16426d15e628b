"""Engines that run a `.colibri` file: the NumPy reference engine (here) and the CUDA engine (device="cuda")."""

from colibri_format.runtime.engine import (Engine, EngineConfig, GenerationResult, GenerationStats, colibri_free,
                                           colibri_infer, colibri_init)

__all__ = ["Engine", "EngineConfig", "GenerationResult", "GenerationStats",
           "colibri_init", "colibri_infer", "colibri_free"]
