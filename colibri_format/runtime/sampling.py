"""Choosing the next token from a logits row, and stopping on text.

The chain, in Hugging Face's order: the repetition penalty on the logits, then greedy at temperature 0, else
temperature, top-k, top-p (nucleus), min-p, and one draw. Every filter left at its default (top_k=0, top_p=1,
min_p=0, repetition_penalty=1) is skipped, so the defaults draw exactly what plain temperature sampling draws.

    distribution(logits, 0.7, top_k=40, top_p=0.95)      # the probabilities a draw uses, [V] float64
    Sampler(0.7, seed=1, repetition_penalty=1.1, context=prompt)(logits)   # one token, remembered as context
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence

import numpy as np

from colibri_format.errors import InvalidInput

MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 256


def _number(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidInput(f"{name} must be a number", field=name, value=value)
    return float(value)


def check_sampling(temperature: float, top_p: float, top_k: int = 0, min_p: float = 0.0,
                   repetition_penalty: float = 1.0) -> None:
    """Raise InvalidInput for a value outside its range (NaN and infinities included)."""
    t = _number(temperature, "temperature")
    if not (math.isfinite(t) and t >= 0.0):
        raise InvalidInput("temperature must be a finite number >= 0 (0 = greedy)", field="temperature",
                           value=temperature)
    if not 0.0 < _number(top_p, "top_p") <= 1.0:
        raise InvalidInput("top_p must be in (0, 1] (1 = off)", field="top_p", value=top_p)
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise InvalidInput("top_k must be an integer >= 0 (0 = off)", field="top_k", value=top_k)
    if not 0.0 <= _number(min_p, "min_p") <= 1.0:
        raise InvalidInput("min_p must be in [0, 1] (0 = off)", field="min_p", value=min_p)
    r = _number(repetition_penalty, "repetition_penalty")
    if not (math.isfinite(r) and r > 0.0):
        raise InvalidInput("repetition_penalty must be a finite number > 0 (1 = off)", field="repetition_penalty",
                           value=repetition_penalty)


# --- the steps of the chain ---------------------------------------------------------------------------
def penalize(logits: np.ndarray, context: Iterable[int], penalty: float) -> np.ndarray:
    """The CTRL / Hugging Face repetition penalty: the logit of every token id in `context` is divided by
    `penalty` when positive, multiplied by it when negative (so penalty > 1 makes repeats less likely)."""
    if penalty == 1.0:
        return logits
    seen = np.fromiter(set(context), dtype=np.int64)
    seen = seen[(seen >= 0) & (seen < logits.shape[-1])]
    if seen.size == 0:
        return logits
    out = logits.astype(np.float64)
    chosen = out[seen]
    out[seen] = np.where(chosen > 0, chosen / penalty, chosen * penalty)
    return out


def softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    """softmax(logits / temperature) in float64. A temperature so small that logits / temperature overflows
    takes the limit instead: all the mass on the largest logit(s), never NaN."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        z = logits.astype(np.float64) / temperature
        if not np.isfinite(z).all():
            z = (logits.astype(np.float64) - logits.max()) / temperature     # 0 at the max, else finite or -inf
    probs = np.exp(z - z.max())
    return probs / probs.sum()


def top_k_filter(probs: np.ndarray, top_k: int) -> np.ndarray:
    """Keep the `top_k` most probable tokens (and any tied with the k-th, as Hugging Face does); renormalise."""
    if top_k <= 0 or top_k >= probs.shape[-1]:
        return probs
    kth = np.partition(probs, -top_k)[-top_k]
    out = np.where(probs >= kth, probs, 0.0)
    return out / out.sum()


def nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Zeroes every token outside the smallest most-probable set whose mass reaches top_p; renormalises."""
    order = np.argsort(-probs, kind="stable")
    mass_before = np.cumsum(probs[order]) - probs[order]
    keep = order[mass_before < top_p]          # the token that crosses top_p is kept
    out = np.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()


def min_p_filter(probs: np.ndarray, min_p: float) -> np.ndarray:
    """Keep the tokens at least `min_p` times as probable as the most probable one; renormalise."""
    if min_p <= 0.0:
        return probs
    out = np.where(probs >= min_p * probs.max(), probs, 0.0)
    return out / out.sum()


def distribution(logits: np.ndarray, temperature: float, top_p: float = 1.0, *, top_k: int = 0,
                 min_p: float = 0.0, repetition_penalty: float = 1.0, context: Iterable[int] = ()) -> np.ndarray:
    """The probabilities one draw uses ([V] float64); temperature must be > 0 (0 is greedy: no draw)."""
    logits = penalize(logits, context, repetition_penalty)
    probs = softmax(logits, temperature)
    probs = top_k_filter(probs, top_k)
    if top_p < 1.0:
        probs = nucleus(probs, top_p)
    return min_p_filter(probs, min_p)


def sample(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator, *, top_k: int = 0,
           min_p: float = 0.0, repetition_penalty: float = 1.0, context: Iterable[int] = ()) -> int:
    if temperature == 0.0:
        return int(np.argmax(penalize(logits, context, repetition_penalty)))
    probs = distribution(logits, temperature, top_p, top_k=top_k, min_p=min_p,
                         repetition_penalty=repetition_penalty, context=context)
    return int(rng.choice(len(probs), p=probs))


class Sampler:
    """The token picker of one generation: checked settings, a seeded generator, and the context (prompt, then
    every token picked) the repetition penalty looks at."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, *, top_k: int = 0,
                 min_p: float = 0.0, repetition_penalty: float = 1.0, context: Iterable[int] = ()) -> None:
        check_sampling(temperature, top_p, top_k, min_p, repetition_penalty)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0):
            raise InvalidInput("seed must be an integer >= 0", field="seed", value=seed)
        self.temperature, self.top_p, self.top_k = float(temperature), float(top_p), int(top_k)
        self.min_p, self.repetition_penalty = float(min_p), float(repetition_penalty)
        self.rng = np.random.default_rng(seed)
        self.seen = {int(t) for t in context}

    @property
    def greedy(self) -> bool:
        """Whether every pick is the plain argmax of the logits (what the device can pick itself)."""
        return self.temperature == 0.0 and self.repetition_penalty == 1.0

    def picked(self, token: int) -> int:
        """`token`, picked elsewhere by this sampler's greedy rule, added to the context."""
        self.seen.add(int(token))
        return int(token)

    def __call__(self, logits: np.ndarray) -> int:
        token = sample(logits, self.temperature, self.top_p, self.rng, top_k=self.top_k, min_p=self.min_p,
                       repetition_penalty=self.repetition_penalty, context=self.seen)
        self.seen.add(token)
        return token


# --- stop strings ---------------------------------------------------------------------------------------
def check_stop_strings(stop_strings: object) -> tuple[str, ...]:
    """A list of non-empty strings, or InvalidInput."""
    if stop_strings is None:
        return ()
    if isinstance(stop_strings, (str, bytes)) or not isinstance(stop_strings, Sequence):
        raise InvalidInput("stop_strings must be a list of strings", field="stop_strings",
                           value=type(stop_strings).__name__)
    if len(stop_strings) > MAX_STOP_STRINGS:
        raise InvalidInput(f"at most {MAX_STOP_STRINGS} stop strings", field="stop_strings", value=len(stop_strings))
    for i, s in enumerate(stop_strings):
        if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS:
            raise InvalidInput(f"a stop string must be text of 1 to {MAX_STOP_CHARS} characters",
                               field=f"stop_strings[{i}]", value=s)
    return tuple(stop_strings)


def find_stop(text: str, stop_strings: Sequence[str], start: int = 0) -> int:
    """Where the first stop string begins in `text` (searching from `start`), or -1."""
    hits = [i for i in (text.find(s, start) for s in stop_strings) if i >= 0]
    return min(hits) if hits else -1


def partial_stop(text: str, stop_strings: Sequence[str]) -> int:
    """How many characters at the end of `text` could be the start of a stop string (to hold back from a stream)."""
    longest = 0
    for s in stop_strings:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


class StopStrings:
    """Ends a generation once its decoded text holds one of `stop_strings`; `cut` the text before it."""

    def __init__(self, stop_strings: Sequence[str], tokenizer) -> None:
        self.strings = check_stop_strings(stop_strings)
        if self.strings and tokenizer is None:
            raise InvalidInput("stop strings need a tokenizer, and this file embeds none", field="stop_strings")
        self.tokenizer = tokenizer
        self.at = -1                           # where the stop string begins in the text, once reached
        self._searched = 0

    def reached(self, ids: Sequence[int]) -> bool:
        text = self.tokenizer.decode(list(ids))
        longest = max(len(s) for s in self.strings)
        # only the new text can hold a new match (a few characters more: a partial UTF-8 character may resolve)
        self.at = find_stop(text, self.strings, max(0, min(self._searched, len(text)) - longest - 4))
        self._searched = len(text)
        return self.at >= 0

    def cut(self, text: str) -> str:
        return text[:self.at] if self.at >= 0 else text
