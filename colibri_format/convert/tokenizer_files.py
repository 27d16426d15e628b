"""The checkpoint's tokenizer files, read for embedding in the `.colibri` metadata.

Returns the design-doc `tokenizer` object: `tokenizer_json` as the original text
(validated as a JSON object, stored verbatim), plus the parsed `tokenizer_config`
and `generation_config`. A chat template shipped as `chat_template.jinja` (newer
transformers) is folded into `tokenizer_config["chat_template"]` when the config
has none. Every file goes through the same size caps and path checks as weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from colibri_format.convert.hf_config import parse_json_object
from colibri_format.convert.safe_paths import read_capped, resolve_member
from colibri_format.errors import InvalidInput

TOKENIZER_JSON_MAX_BYTES = 64 << 20
CONFIG_MAX_BYTES = 16 << 20
TEMPLATE_MAX_BYTES = 1 << 20


def _read_text(root: Path, name: str, cap: int) -> str | None:
    if not (root / name).exists():
        return None
    data = read_capped(resolve_member(root, name, field=name), max_bytes=cap, field=name)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"{name} is not UTF-8", field=name) from exc


def _read_object(root: Path, name: str, cap: int) -> dict[str, Any] | None:
    text = _read_text(root, name, cap)
    return None if text is None else parse_json_object(text.encode("utf-8"), what=name)


def read_tokenizer(checkpoint_dir: str | Path) -> dict[str, Any] | None:
    """`{"tokenizer_json", "tokenizer_config", "generation_config"}`, or None without tokenizer.json."""
    root = Path(checkpoint_dir)
    tokenizer_json = _read_text(root, "tokenizer.json", TOKENIZER_JSON_MAX_BYTES)
    if tokenizer_json is None:
        return None
    parse_json_object(tokenizer_json.encode("utf-8"), what="tokenizer.json")
    config = _read_object(root, "tokenizer_config.json", CONFIG_MAX_BYTES) or {}
    if config.get("chat_template") is None:
        template = _read_text(root, "chat_template.jinja", TEMPLATE_MAX_BYTES)
        if template is not None:
            config["chat_template"] = template
    generation = _read_object(root, "generation_config.json", CONFIG_MAX_BYTES) or {}
    return {"tokenizer_json": tokenizer_json, "tokenizer_config": config, "generation_config": generation}
