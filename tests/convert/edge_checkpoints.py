"""Small synthetic checkpoints with one thing wrong, for the data-safety tests (no torch needed).

`make_small` writes a float32 Mixtral-layout checkpoint (2 layers x 4 experts, hidden 64, a few shards);
the other helpers damage it the way a real checkpoint can be damaged: a value or whole rows poked in place
(optionally keeping the shard's mtime), extra tensors in an extra shard, a JSON file replaced by raw text.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from colibri_format.convert.safetensors_file import SafetensorsFile
from colibri_format.dtypes import STORAGE
from tests.convert.synth_checkpoint import mixtral_config, write_checkpoint

INDEX = "model.safetensors.index.json"


def small_config(**overrides: Any) -> dict:
    return {**mixtral_config(vocab=128, hidden=64, layers=2, experts=4, inter=32, heads=4), **overrides}


def make_small(folder: Path, *, dtype: str = "float32", seed: int = 0, **config: Any) -> Path:
    """A small sharded checkpoint in `folder` (config overrides as keywords)."""
    write_checkpoint(folder, small_config(**config), dtype=dtype, shard_bytes=48 << 10, seed=seed)
    return folder


def shard_of(ckpt: Path, name: str) -> Path:
    if not (ckpt / INDEX).exists():
        return ckpt / "model.safetensors"
    return ckpt / json.loads((ckpt / INDEX).read_text())["weight_map"][name]


def element_offset(ckpt: Path, name: str, index: tuple[int, ...]) -> tuple[Path, int, np.dtype]:
    """(shard, byte offset of element `index` of tensor `name`, its storage dtype)."""
    shard = shard_of(ckpt, name)
    f = SafetensorsFile(shard, shard.name)
    entry = f.entries[name]
    dtype = STORAGE[f.dtype(name)]
    flat = int(np.ravel_multi_index(index, entry.shape))
    return shard, f.data_start + entry.begin + flat * dtype.itemsize, dtype


def poke(ckpt: Path, name: str, index: tuple[int, ...], value: float, *, keep_mtime: bool = False) -> int:
    """Write `value` into one element of a tensor in place (same size); returns its byte offset."""
    shard, offset, dtype = element_offset(ckpt, name, index)
    st = os.stat(shard)
    raw = np.array([value], np.float32).view(np.uint32) >> 16 if dtype == np.uint16 else np.array([value], dtype)
    with open(shard, "r+b") as fh:
        fh.seek(offset)
        fh.write(raw.astype(dtype).tobytes())
    if keep_mtime:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    return offset


def poke_rows(ckpt: Path, name: str, rows: dict[int, np.ndarray]) -> None:
    """Overwrite whole rows of a 2-D tensor in place (values cast to its storage dtype; float32/float64 only)."""
    shard, offset, dtype = element_offset(ckpt, name, (0, 0))
    f = SafetensorsFile(shard, shard.name)
    width = f.entries[name].shape[1]
    with open(shard, "r+b") as fh:
        for row, values in rows.items():
            fh.seek(offset + row * width * dtype.itemsize)
            fh.write(np.asarray(values, dtype).reshape(width).tobytes())


def read_element(ckpt: Path, name: str, index: tuple[int, ...]) -> bytes:
    shard, offset, dtype = element_offset(ckpt, name, index)
    with open(shard, "rb") as fh:
        fh.seek(offset)
        return fh.read(dtype.itemsize)


def add_tensors(ckpt: Path, tensors: dict[str, np.ndarray], shard: str = "extra.safetensors") -> None:
    """Put extra tensors in a shard of their own and list them in the index."""
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(ckpt / shard))
    index = json.loads((ckpt / INDEX).read_text())
    index["weight_map"].update({name: shard for name in tensors})
    (ckpt / INDEX).write_text(json.dumps(index, indent=1))


def edit_config(ckpt: Path, **changes: Any) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(changes)
    (ckpt / "config.json").write_text(json.dumps(cfg, indent=1))


def to_float64(ckpt: Path) -> None:
    """Rewrite every shard with float64 tensors (same names and values)."""
    from safetensors.numpy import load_file, save_file

    for shard in sorted(ckpt.glob("*.safetensors")):
        save_file({k: v.astype(np.float64) for k, v in load_file(str(shard)).items()}, str(shard))


def tokenizer_json(vocab_size: int = 128) -> str:
    """A real (word-level) tokenizer.json that the `tokenizers` library loads."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str()


def add_tokenizer(ckpt: Path, *, config: dict | None = None, generation: dict | None = None) -> None:
    (ckpt / "tokenizer.json").write_text(tokenizer_json())
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config if config is not None else
                                                           {"bos_token": "<s>", "eos_token": "</s>"}))
    (ckpt / "generation_config.json").write_text(json.dumps(generation if generation is not None else
                                                            {"eos_token_id": 2}))
