"""The bundled demo checkpoint (models/colibri-demo-moe) loads with transformers and still scores as trained.

transformers is only the oracle here; the colibri_format package never imports it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "colibri-demo-moe"
SHIPPED = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
           "generation_config.json", "eval.txt", "training_report.json", "README.md"]


@pytest.fixture(scope="module")
def report():
    return json.loads((MODEL_DIR / "training_report.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    m = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    m.eval()
    return m


def test_files_present_and_small():
    for name in SHIPPED:
        assert (MODEL_DIR / name).is_file(), name
    assert (MODEL_DIR / "model.safetensors").stat().st_size <= 16 * 2**20
    assert (MODEL_DIR / "eval.txt").stat().st_size <= 300_000


def test_config(model, report):
    c = model.config
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert c.model_type == "qwen3_moe"
    assert c.num_experts == 8
    assert c.num_experts_per_tok == 2
    assert 4 <= c.num_hidden_layers <= 6
    assert c.mlp_only_layers == [] and c.decoder_sparse_step == 1  # every layer is an MoE layer
    assert 4096 <= c.vocab_size <= 8192
    assert c.tie_word_embeddings
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == report["params"]
    for key, value in report["config"].items():
        assert getattr(c, key) == value, key


def test_tokenizer_round_trip(tokenizer):
    snippet = (
        "def mean(values: list[float]) -> float:\n"
        '    """Arithmetic mean; raises on empty input."""\n'
        "    if not values:\n"
        "        raise ValueError('empty')  # tab\there, unicode: \u00e9\u2192\n"
        "    return sum(values) / len(values)\n"
    )
    ids = tokenizer(snippet, add_special_tokens=False).input_ids
    assert all(0 <= i < 4096 for i in ids)
    assert tokenizer.decode(ids) == snippet
    with_bos = tokenizer(snippet).input_ids
    assert with_bos[0] == tokenizer.bos_token_id and with_bos[1:] == ids
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")


def test_heldout_loss_matches_report(model, tokenizer, report):
    # Same recipe as tools/train_demo_model.py: <|bos|> + eval.txt tokens, 4 windows of 512.
    text = (MODEL_DIR / "eval.txt").read_text(encoding="utf-8")
    seq_len, n_seq = 512, 4
    ids = tokenizer(text[:40_000]).input_ids[: n_seq * seq_len + 1]
    assert len(ids) == n_seq * seq_len + 1
    x = torch.tensor(ids)
    with torch.no_grad():
        logits = model(input_ids=x[:-1].view(n_seq, seq_len), use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x[1:]).item()
    reference = report["heldout"]["first_2049_tokens_loss_cpu_fp32"]
    assert math.isfinite(loss)
    assert loss <= reference * 1.10, (loss, reference)
    # and far better than an untrained model (uniform over 4096 tokens: ln 4096 = 8.3)
    assert loss < 0.5 * math.log(model.config.vocab_size)


def test_router_not_collapsed(report):
    frac = report["routing"]["fraction_per_expert"]
    assert len(frac) == report["config"]["num_hidden_layers"]
    for row in frac:
        assert len(row) == 8
        assert abs(sum(row) - 1.0) < 1e-3
        assert max(row) <= 0.5 and min(row) >= 0.01
    assert report["routing"]["collapsed"] is False
