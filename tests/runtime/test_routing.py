"""Router semantics of the metadata `router` object, on hand-made logits (no transformers needed).

`numpy_backend.router` takes the hidden state and the router matrix; with an identity matrix the router
logits are the hand-made ones. Float64 inputs: the oracle the CUDA kernels are tested against.
"""

from __future__ import annotations

import numpy as np

from colibri_format.runtime.numpy_backend import count_routes, expert_ffn, moe, router, silu, softmax

LOGITS = np.array([[2.0, 0.5, 1.0, -1.0]])   # one token, four experts
EYE = np.eye(4)


def route(logits, k: int, bias=None, **how):
    """(weights, ids) of the router over `logits`."""
    ids, weights = router(logits, EYE, k, bias=bias, **how)
    assert ids.dtype == np.int32 and weights.dtype == logits.dtype
    return weights, ids


def test_softmax_then_topk_with_and_without_renormalisation():
    p = softmax(LOGITS)
    raw, idx = route(LOGITS, 2, order="softmax_topk", normalize=False)
    assert idx.tolist() == [[0, 2]]
    np.testing.assert_allclose(raw, p[:, [0, 2]], rtol=1e-12)
    norm, _ = route(LOGITS, 2, order="softmax_topk", normalize=True)
    np.testing.assert_allclose(norm, p[:, [0, 2]] / p[:, [0, 2]].sum(), rtol=1e-12)


def test_topk_then_softmax_over_the_k_and_scale():
    w, idx = route(LOGITS, 2, order="topk_softmax", scale=2.5)
    assert idx.tolist() == [[0, 2]]
    np.testing.assert_allclose(w, 2.5 * softmax(LOGITS[:, [0, 2]]), rtol=1e-12)


def test_a_router_bias_steers_selection_but_not_weights():
    bias = np.array([0.0, 0.0, 0.0, 5.0])
    w, idx = route(LOGITS, 2, bias=bias, scoring="sigmoid", order="softmax_topk", normalize=False)
    assert idx.tolist() == [[3, 0]]
    np.testing.assert_allclose(w, 1 / (1 + np.exp(-LOGITS[:, [3, 0]])), rtol=1e-12)


def test_ties_go_to_the_lower_expert_index():
    _, idx = route(np.array([[1.0, 3.0, 3.0, 3.0]]), 2)
    assert idx.tolist() == [[1, 2]]


def test_expert_rows_are_gate_then_up():
    x = np.array([[1.0, 2.0]])
    gate, up = np.array([[0.5, 0.25]]), np.array([[1.0, 1.0]])
    down = np.array([[2.0], [3.0]])
    y = expert_ffn(x, np.concatenate([gate, up]), down)
    np.testing.assert_allclose(y, (silu(x @ gate.T) * (x @ up.T)) @ down.T, rtol=1e-12)
    assert not np.allclose(y, expert_ffn(x, np.concatenate([up, gate]), down))


def test_moe_adds_the_weighted_routed_experts_to_the_residual():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2))
    arrays = {e: (rng.standard_normal((2, 2)), rng.standard_normal((2, 1))) for e in range(4)}
    ids = np.array([[0, 2], [3, 0], [1, 2]], np.int32)
    weights = rng.random((3, 2))
    h0 = rng.standard_normal((3, 2))
    h = moe(x, ids, weights, lambda e: arrays[e], residual=h0.copy(), alpha=0.5)
    expected = h0 + 0.5 * np.stack([sum(weights[t, j] * expert_ffn(x[t:t + 1], *arrays[ids[t, j]])[0]
                                        for j in range(2)) for t in range(3)])
    np.testing.assert_allclose(h, expected, rtol=1e-12)


def test_count_routes_counts_pairs_per_expert_and_wraps():
    totals = np.array([0, 2**32 - 1, 5, 0], np.uint32)
    count_routes(np.array([[1, 2], [1, 0], [7, -1]], np.int32), totals)     # 7 and -1: outside [0, E), ignored
    np.testing.assert_array_equal(totals, np.array([1, 1, 6, 0], np.uint32))  # expert 1 wrapped modulo 2^32
