"""Choosing the next token from a logits row: greedy at temperature 0, else temperature + nucleus (top-p)."""

from __future__ import annotations

import numpy as np

from colibri_format.errors import InvalidInput


def check_sampling(temperature: float, top_p: float) -> None:
    if not temperature >= 0.0:
        raise InvalidInput("temperature must be >= 0", field="temperature", value=temperature)
    if not 0.0 < top_p <= 1.0:
        raise InvalidInput("top_p must be in (0, 1]", field="top_p", value=top_p)


def nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Zeroes every token outside the smallest most-probable set whose mass reaches top_p; renormalises."""
    order = np.argsort(-probs, kind="stable")
    mass_before = np.cumsum(probs[order]) - probs[order]
    keep = order[mass_before < top_p]          # the token that crosses top_p is kept
    out = np.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()


def sample(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    if temperature == 0.0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if top_p < 1.0:
        probs = nucleus(probs, top_p)
    return int(rng.choice(len(probs), p=probs))
