"""Adapters and layout: canonical dense tensors and per-expert tensors equal the transformers module's weights.

The reference is the in-memory model's own `state_dict` (the v5 runtime layout: fused
`experts.gate_up_proj [E, 2I, H]`), so both disk layouts are checked against one truth.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from colibri_format.convert.adapters import get_adapter, normalize_config
from colibri_format.convert.layout import dense_tensors
from colibri_format.convert.source import open_checkpoint
from colibri_format.errors import InvalidInput
from colibri_format.spec import canonical_dense_tensors
from tests.convert.hf_checkpoint import expert_tensors, read_dense
from tests.hf_models import ARCHS

GRANITE = ("granitemoe", "granitemoeshared")


def moe_prefix(arch: str, i: int) -> str:
    return f"model.layers.{i}.{'block_sparse_moe' if arch in GRANITE else 'mlp'}"


def reference_dense(arch: str, name: str, model: dict[str, Any], ref: dict[str, np.ndarray]) -> np.ndarray:
    """The state_dict tensor behind a canonical name, written independently of the adapters."""
    globals_ = {"embed_tokens": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
                "lm_head": "lm_head.weight"}
    if name in globals_:
        return ref[globals_[name]]
    _, i, rest = name.split(".", 2)
    p = f"model.layers.{i}"
    simple = {"input_norm": "input_layernorm.weight", "post_attn_norm": "post_attention_layernorm.weight",
              "moe.shared_gate": "mlp.shared_expert_gate.weight",
              "moe.router_bias": {"glm4_moe": "mlp.gate.e_score_correction_bias", "gpt_oss": "mlp.router.bias",
                                  "minimax_m2": "mlp.e_score_correction_bias"}.get(arch),
              "attn.sinks": "self_attn.sinks", "moe.expert_down_bias": "mlp.experts.down_proj_bias"}
    if rest == "moe.expert_gate_up_bias":                     # gpt-oss: gate and up interleaved -> gate first
        bias = ref[f"{p}.mlp.experts.gate_up_proj_bias"]
        return np.concatenate([bias[:, 0::2], bias[:, 1::2]], axis=1)
    for x in ("q", "k", "v", "o"):
        simple[f"attn.{x}_proj"] = f"self_attn.{x}_proj.weight"
        simple[f"attn.{x}_bias"] = f"self_attn.{x}_proj.bias"
        simple[f"attn.{x}_norm"] = f"self_attn.{x}_norm.weight"
    for x in ("gate_proj", "up_proj", "down_proj"):
        simple[f"mlp.{x}"] = f"mlp.{x}.weight"
        simple[f"moe.shared.{x}"] = f"mlp.{'shared_experts' if arch == 'glm4_moe' else 'shared_expert'}.{x}.weight"
    if rest == "moe.router":
        return ref[f"{moe_prefix(arch, int(i))}.{'router' if arch in GRANITE + ('gpt_oss',) else 'gate'}.weight"]
    if arch == "granitemoeshared" and rest.startswith("moe.shared."):
        i_s = model["shared_expert"]["intermediate_size"]
        fused = ref[f"{p}.shared_mlp.input_linear.weight"]
        return {"moe.shared.gate_proj": fused[:i_s], "moe.shared.up_proj": fused[i_s:],
                "moe.shared.down_proj": ref[f"{p}.shared_mlp.output_linear.weight"]}[rest]
    return ref[f"{p}.{simple[rest]}"]


def open_and_normalize(folder: Path) -> tuple[Any, Any, dict[str, Any]]:
    src = open_checkpoint(folder)
    arch, model = normalize_config(src.config.raw)
    adapter = get_adapter(arch)
    return adapter.source(src), adapter, model


LAYOUTS = [(arch, fused, sharded) for arch in ARCHS for fused, sharded in [(False, False), (True, True)]]
LAYOUTS += [("mixtral", False, True), ("qwen2_moe", True, False)]


@pytest.mark.parametrize("arch, fused, sharded", LAYOUTS)
def test_dense_tensors_match_the_module(tiny_checkpoint: Any, tiny_reference: Any, arch: str, fused: bool,
                                        sharded: bool) -> None:
    ref = tiny_reference(arch)
    src, adapter, model = open_and_normalize(tiny_checkpoint(arch, fused=fused, sharded=sharded))
    with src:
        dense = dense_tensors(src, model, adapter.names)
        assert [(t.name, read_dense(src, t).shape) for t in dense] == canonical_dense_tensors(model)
        for t in dense:
            np.testing.assert_array_equal(read_dense(src, t), reference_dense(arch, t.name, model, ref),
                                          err_msg=t.name)


@pytest.mark.parametrize("arch, fused, sharded", LAYOUTS)
def test_expert_tensors_match_the_module(tiny_checkpoint: Any, tiny_reference: Any, arch: str, fused: bool,
                                         sharded: bool) -> None:
    ref = tiny_reference(arch)
    src, adapter, model = open_and_normalize(tiny_checkpoint(arch, fused=fused, sharded=sharded))
    i_size, h = model["expert_intermediate_size"], model["hidden_size"]
    with src:
        for layer, expert in itertools.product(model["moe_layers"], range(model["num_experts"])):
            gate, up, down = expert_tensors(src, model, adapter, layer, expert)
            gate_up = ref[f"{moe_prefix(arch, layer)}.experts.gate_up_proj"][expert]
            down_ref = ref[f"{moe_prefix(arch, layer)}.experts.down_proj"][expert]
            if arch == "gpt_oss":     # in-features first, gate and up columns interleaved
                gate_up = np.concatenate([gate_up[:, 0::2], gate_up[:, 1::2]], axis=1).T
                down_ref = down_ref.T
            assert gate.shape == up.shape == (i_size, h) and down.shape == (h, i_size)
            assert all(a.dtype == np.float32 for a in (gate, up, down))
            np.testing.assert_array_equal(gate, gate_up[:i_size])
            np.testing.assert_array_equal(up, gate_up[i_size:])
            np.testing.assert_array_equal(down, down_ref)


@pytest.mark.parametrize("arch", ["granitemoe", "mixtral"])
def test_tied_checkpoint_has_no_lm_head(tiny_checkpoint: Any, tiny_reference: Any, arch: str) -> None:
    src, adapter, model = open_and_normalize(tiny_checkpoint(arch, tie=True))
    with src:
        assert not src.has("lm_head.weight")
        names = [t.name for t in dense_tensors(src, model, adapter.names)]
        assert "lm_head" not in names and names[0] == "embed_tokens"
        embed = next(t for t in dense_tensors(src, model, adapter.names) if t.name == "embed_tokens")
        np.testing.assert_array_equal(read_dense(src, embed), tiny_reference(arch, tie=True)["lm_head.weight"])


def test_bf16_experts_upcast_exactly(tiny_checkpoint: Any, tiny_reference: Any) -> None:
    ref = tiny_reference("qwen3_moe", dtype="bfloat16")
    src, adapter, model = open_and_normalize(tiny_checkpoint("qwen3_moe", dtype="bfloat16"))
    with src:
        gate, up, down = expert_tensors(src, model, adapter, 1, 3)
        np.testing.assert_array_equal(down, ref["model.layers.1.mlp.experts.down_proj"][3])


# --- mismatches ------------------------------------------------------------------------------------

def edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_config_weights_disagreement_is_a_clear_error(tiny_checkpoint: Any, tmp_path: Path) -> None:
    folder = shutil.copytree(tiny_checkpoint("mixtral", fused=True), tmp_path / "ckpt")
    edit_config(folder, intermediate_size=8)
    src, adapter, model = open_and_normalize(folder)
    with src, pytest.raises(InvalidInput, match=r"gate_up_proj.*expected \(4, 16, 32\)"):
        expert_tensors(src, model, adapter, 0, 0)
    edit_config(folder, intermediate_size=16, vocab_size=64)
    src, adapter, model = open_and_normalize(folder)
    with src, pytest.raises(InvalidInput, match="embed_tokens.*disagree"):
        dense_tensors(src, model, adapter.names)


def test_untied_config_with_missing_lm_head_is_rejected(tiny_checkpoint: Any, tmp_path: Path) -> None:
    folder = shutil.copytree(tiny_checkpoint("granitemoe", tie=True), tmp_path / "ckpt")
    edit_config(folder, tie_word_embeddings=False)
    src, adapter, model = open_and_normalize(folder)
    with src, pytest.raises(InvalidInput, match="lm_head"):
        dense_tensors(src, model, adapter.names)


def test_expert_index_out_of_range_and_dense_layer(tiny_checkpoint: Any) -> None:
    src, adapter, model = open_and_normalize(tiny_checkpoint("qwen2_moe"))
    with src:
        for layer, expert in [(0, 0), (1, 4), (1, -1), (9, 0)]:  # layer 0 is dense in the fixture
            with pytest.raises(InvalidInput):
                expert_tensors(src, model, adapter, layer, expert)


def test_missing_expert_tensors_name_the_layer(tiny_checkpoint: Any, tmp_path: Path) -> None:
    folder = shutil.copytree(tiny_checkpoint("mixtral"), tmp_path / "ckpt")
    edit_config(folder, num_hidden_layers=3)  # layer 2 does not exist on disk
    src, adapter, model = open_and_normalize(folder)
    with src, pytest.raises(InvalidInput, match="model.layers.2"):
        expert_tensors(src, model, adapter, 2, 0)


def test_converter_imports_neither_torch_nor_transformers() -> None:
    import subprocess
    import sys

    code = ("import sys, colibri_format.convert.source, colibri_format.convert.quantize, "
            "colibri_format.convert.pipeline, colibri_format.convert.adapters as a\n"
            "[a.get_adapter(t) for t in a.SUPPORTED_MODEL_TYPES]\n"
            "print(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("arch", ["qwen2_moe", "granitemoeshared"])
def test_open_hf_checkpoint_facade(tiny_checkpoint: Any, tiny_reference: Any, arch: str) -> None:
    from tests.convert.hf_checkpoint import open_hf_checkpoint

    ref = tiny_reference(arch)
    with open_hf_checkpoint(tiny_checkpoint(arch, fused=True, sharded=True)) as ckpt:
        assert ckpt.architecture == arch and ckpt.model["num_experts"] == 4
        dense = ckpt.dense_tensors()
        assert [(t.name, ckpt.read_dense(t).shape) for t in dense] == canonical_dense_tensors(ckpt.model)
        assert np.array_equal(ckpt.read_dense(dense[0]), ref["model.embed_tokens.weight"])
        keys = list(ckpt.expert_keys())
        assert keys == [(layer, e) for layer in ckpt.model["moe_layers"] for e in range(4)]
        gate, _, _ = ckpt.expert(*keys[-1])
        layer, e = keys[-1]
        np.testing.assert_array_equal(gate, ref[f"{moe_prefix(arch, layer)}.experts.gate_up_proj"][e][:16])
        assert ckpt.tokenizer() is None  # the tiny fixtures ship no tokenizer


@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe", "granitemoe"])
def test_attention_bias_gives_qkv_and_o_biases(tmp_path: Path, arch: str) -> None:
    from tests.hf_models import make_tiny_checkpoint, reference_state

    folder = make_tiny_checkpoint(arch, tmp_path, attention_bias=True, seed=5)
    ref = reference_state(arch, attention_bias=True, seed=5)
    src, adapter, model = open_and_normalize(folder)
    assert model["qkv_bias"] and model["o_bias"]
    with src:
        dense = {t.name: t for t in dense_tensors(src, model, adapter.names)}
        for x in "qkvo":
            np.testing.assert_array_equal(read_dense(src, dense[f"layers.1.attn.{x}_bias"]),
                                          ref[f"model.layers.1.self_attn.{x}_proj.bias"])
