"""The NumPy ops of the GLM-4.5 / MiniMax-M2 / gpt-oss features against the transformers modules they copy
(float64 here, the oracle the CUDA kernels are held to)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf

from colibri_format.runtime.args import ModelArgs
from colibri_format.runtime.numpy_backend import group_mask, router
from colibri_format.synthetic import synthetic_model


def _sorted(ids, weights):
    order = np.argsort(ids, axis=-1)
    return np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)


@pytest.mark.parametrize("groups, norm", [((1, 1), True), ((4, 2), False), ((8, 3), True)])
def test_grouped_sigmoid_router_matches_glm(groups, norm):
    cfg = tf.Glm4MoeConfig(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=groups[0],
                           topk_group=groups[1], norm_topk_prob=norm, routed_scaling_factor=2.5)
    gate = tf.models.glm4_moe.modeling_glm4_moe.Glm4MoeTopkRouter(cfg).double()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        gate.weight.copy_(0.3 * torch.randn(gate.weight.shape, generator=gen))
        gate.e_score_correction_bias.copy_(0.5 * torch.randn(16, generator=gen))
    x = torch.randn(300, 32, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        _, ref_w, ref_ids = gate(x)
    grouped = groups if groups[1] < groups[0] else None
    ids, w = router(x.numpy(), gate.weight.detach().numpy(), 4, bias=gate.e_score_correction_bias.numpy(),
                    scoring="sigmoid", normalize=norm, scale=2.5, groups=grouped)
    got, exp = _sorted(ids, w), _sorted(ref_ids.numpy(), ref_w.numpy())
    np.testing.assert_array_equal(got[0], exp[0])
    np.testing.assert_allclose(got[1], exp[1], rtol=1e-6)    # the GLM router computes in float32


def test_group_mask_keeps_the_groups_with_the_best_two_keys():
    key = np.array([[0.9, 0.0, 0.5, 0.5, 0.8, 0.1]])          # groups of 2: sums 0.9, 1.0, 0.9
    np.testing.assert_array_equal(group_mask(key, (3, 1)), [[-np.inf, -np.inf, 0.5, 0.5, -np.inf, -np.inf]])
    np.testing.assert_array_equal(np.isfinite(group_mask(key, (3, 2))), [[True, True, True, True, False, False]])


def test_window_applies_to_the_sliding_layers_only():
    m = {**synthetic_model(layers=3), "sliding_window": 4}
    assert [ModelArgs.from_dict(m).window(i) for i in range(3)] == [4, 4, 4]
    args = ModelArgs.from_dict({**m, "sliding_layers": [0, 2]})
    assert [args.window(i) for i in range(3)] == [4, 0, 4]
    assert ModelArgs.from_dict(synthetic_model()).window(0) == 0
