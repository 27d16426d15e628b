"""Router semantics of the metadata `router` object, on hand-made logits (no transformers needed)."""

from __future__ import annotations

import numpy as np

from colibri_format.runtime.model import expert_ffn, route, silu, softmax

LOGITS = np.array([[2.0, 0.5, 1.0, -1.0]], np.float32)   # one token, four experts


def test_softmax_then_topk_with_and_without_renormalisation():
    p = softmax(LOGITS)
    raw, idx = route(LOGITS, {"order": "softmax_topk", "normalize_topk": False}, 2)
    assert idx.tolist() == [[0, 2]]
    np.testing.assert_allclose(raw, p[:, [0, 2]], rtol=1e-6)
    norm, _ = route(LOGITS, {"order": "softmax_topk", "normalize_topk": True}, 2)
    np.testing.assert_allclose(norm, p[:, [0, 2]] / p[:, [0, 2]].sum(), rtol=1e-6)


def test_topk_then_softmax_over_the_k_and_scale():
    w, idx = route(LOGITS, {"order": "topk_softmax", "scale": 2.5}, 2)
    assert idx.tolist() == [[0, 2]]
    np.testing.assert_allclose(w, 2.5 * softmax(LOGITS[:, [0, 2]]), rtol=1e-6)


def test_a_router_bias_steers_selection_but_not_weights():
    bias = np.array([0.0, 0.0, 0.0, 5.0], np.float32)
    w, idx = route(LOGITS, {"scoring": "sigmoid", "order": "softmax_topk", "normalize_topk": False}, 2, bias)
    assert idx.tolist() == [[3, 0]]
    np.testing.assert_allclose(w, 1 / (1 + np.exp(-LOGITS[:, [3, 0]])), rtol=1e-6)


def test_expert_rows_are_gate_then_up():
    x = np.array([[1.0, 2.0]], np.float32)
    gate, up = np.array([[0.5, 0.25]], np.float32), np.array([[1.0, 1.0]], np.float32)
    down = np.array([[2.0], [3.0]], np.float32)
    y = expert_ffn(x, np.concatenate([gate, up]), down)
    np.testing.assert_allclose(y, (silu(x @ gate.T) * (x @ up.T)) @ down.T, rtol=1e-6)
    assert not np.allclose(y, expert_ffn(x, np.concatenate([up, gate]), down))
