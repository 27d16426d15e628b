"""The checkpoint's tokenizer files, read for embedding in the `.colibri` metadata.

Returns the design-doc `tokenizer` object: `tokenizer_json` as the original text
(validated as a JSON object, stored verbatim), plus the parsed `tokenizer_config`
and `generation_config`. A chat template shipped as `chat_template.jinja` (newer
transformers) is folded into `tokenizer_config["chat_template"]` when the config
has none. Every file goes through the same size caps and path checks as weights.

What the runtime will rely on is checked here, at convert time, one line per fault (InvalidTokenizer):
`tokenizer.json` must load with the `tokenizers` library; special tokens (`bos_token`, `eos_token`, ...) must be
strings or serialized AddedTokens (`{"content": "..."}`); token ids (`eos_token_id`, ...) integers or lists
of integers, `eos_token_id` inside the vocabulary; the chat template a string or a list of named templates;
and the whole block must be metadata the `.colibri` reader accepts (nesting, Unicode).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from colibri_format import spec as S
from colibri_format.convert.hf_config import parse_json_object
from colibri_format.convert.safe_paths import read_capped, resolve_member, short_repr
from colibri_format.errors import InvalidInput, InvalidMetadata, InvalidTokenizer

METADATA_ROOM = 4 << 20  # what the rest of the metadata (model, quantization errors, provenance) may need
# Each file's cap, checked on its size before it is read: all of them end up in the file's metadata section.
TOKENIZER_JSON_MAX_BYTES = S.MAX_METADATA_BYTES - METADATA_ROOM
CONFIG_MAX_BYTES = 16 << 20
TEMPLATE_MAX_BYTES = 1 << 20
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
TOKEN_IDS = ("eos_token_id", "bos_token_id", "pad_token_id", "decoder_start_token_id")
MAX_TOKEN_ID = (1 << 31) - 1
MAX_ID_LIST = 1024


def max_bytes(name: str) -> int:
    """The cap on one tokenizer file (tokenizer.json, its two configs, chat_template.jinja)."""
    return {"tokenizer.json": TOKENIZER_JSON_MAX_BYTES, "chat_template.jinja": TEMPLATE_MAX_BYTES}.get(
        name, CONFIG_MAX_BYTES)


def read_file(root: Path, name: str) -> bytes | None:
    """The bytes of one tokenizer file, or None when the checkpoint has none; a file over its cap is refused
    on its size, before anything is read or parsed."""
    if not (root / name).exists():
        return None
    path = resolve_member(root, name, field=name)
    size, cap = os.stat(path).st_size, max_bytes(name)
    if size > cap:
        raise InvalidTokenizer(f"{name} is {size:,} bytes, over the {cap:,}-byte cap on it (the tokenizer files "
                               f"are stored in the .colibri metadata, {S.MAX_METADATA_BYTES:,} bytes in all)",
                               field=name, value=size)
    return read_capped(path, max_bytes=cap, field=name)


def _read_text(root: Path, name: str) -> str | None:
    data = read_file(root, name)
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"{name} is not UTF-8", field=name) from exc


def _read_object(root: Path, name: str) -> dict[str, Any] | None:
    text = _read_text(root, name)
    return None if text is None else parse_json_object(text.encode("utf-8"), what=name)


def read_tokenizer(checkpoint_dir: str | Path, *, vocab_size: int | None = None) -> dict[str, Any] | None:
    """`{"tokenizer_json", "tokenizer_config", "generation_config"}`, or None without tokenizer.json.
    Every part is checked (module docstring); `vocab_size` bounds `eos_token_id` when given."""
    root = Path(checkpoint_dir)
    tokenizer_json = _read_text(root, "tokenizer.json")
    if tokenizer_json is None:
        return None
    parse_json_object(tokenizer_json.encode("utf-8"), what="tokenizer.json")
    check_loads(tokenizer_json)
    config = _read_object(root, "tokenizer_config.json") or {}
    if config.get("chat_template") is None:
        template = _read_text(root, "chat_template.jinja")
        if template is not None:
            config["chat_template"] = template
    generation = _read_object(root, "generation_config.json") or {}
    check_tokenizer_config(config)
    check_token_ids(config, "tokenizer_config.json", vocab_size)
    check_token_ids(generation, "generation_config.json", vocab_size)
    block = {"tokenizer_json": tokenizer_json, "tokenizer_config": config, "generation_config": generation}
    _check_storable(block)
    return block


# --- checks -----------------------------------------------------------------------------------------
def check_loads(tokenizer_json: str) -> None:
    """tokenizer.json must load as a tokenizer (what the runtime will do with it)."""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_str(tokenizer_json)
    except Exception as exc:  # the tokenizers library raises a bare Exception
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidTokenizer(f"tokenizer.json does not load as a tokenizer: {short_repr(why, 160)}",
                               field="tokenizer.json") from None


def _token_text_ok(value: Any) -> bool:
    return (value is None or isinstance(value, str)
            or (isinstance(value, dict) and isinstance(value.get("content"), str)))


def check_tokenizer_config(config: dict[str, Any]) -> None:
    """Special tokens are strings or AddedToken objects; the chat template a string or named templates."""
    for key in SPECIAL_TOKENS:
        if not _token_text_ok(config.get(key)):
            raise InvalidTokenizer(f"tokenizer_config.json: {key!r} must be a string or an object with a string "
                                   f"'content', got {short_repr(config.get(key))}", field=key,
                                   value=short_repr(config.get(key)))
    extra = config.get("additional_special_tokens")
    if extra is not None and (not isinstance(extra, list) or not all(_token_text_ok(t) and t is not None
                                                                    for t in extra)):
        raise InvalidTokenizer("tokenizer_config.json: 'additional_special_tokens' must be a list of strings or "
                               f"AddedToken objects, got {short_repr(extra)}", field="additional_special_tokens",
                               value=short_repr(extra))
    template = config.get("chat_template")
    named_ok = isinstance(template, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
        for t in template)
    if not (template is None or isinstance(template, str) or named_ok):
        raise InvalidTokenizer("tokenizer_config.json: 'chat_template' must be a string or a list of "
                               f"{{'name', 'template'}} strings, got {short_repr(template)}", field="chat_template",
                               value=short_repr(template))


def check_token_ids(obj: dict[str, Any], where: str, vocab_size: int | None) -> None:
    """Token ids are integers (or non-empty lists of them); `eos_token_id` lies in [0, vocab_size)."""
    for key in TOKEN_IDS:
        value = obj.get(key)
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        lo, hi = (0, (vocab_size or MAX_TOKEN_ID + 1) - 1) if key == "eos_token_id" else (-1, MAX_TOKEN_ID)
        if (not ids or len(ids) > MAX_ID_LIST
                or any(isinstance(i, bool) or not isinstance(i, int) or not lo <= i <= hi for i in ids)):
            raise InvalidTokenizer(f"{where}: {key!r} must be an integer in [{lo}, {hi}] or a list of them, got "
                                   f"{short_repr(value)}", field=key, value=short_repr(value))


def _check_storable(block: dict[str, Any]) -> None:
    """The block goes into the file's metadata: refuse here what the reader would refuse there."""
    try:
        raw = S.encode_metadata({"tokenizer": block})
        S.decode_metadata(raw)
    except InvalidMetadata as exc:
        raise InvalidTokenizer(f"the tokenizer files cannot be stored in .colibri metadata: {exc}",
                               field="tokenizer") from None
    if len(raw) > S.MAX_METADATA_BYTES - METADATA_ROOM:
        raise InvalidTokenizer(f"the tokenizer files take {len(raw):,} bytes of metadata, over the "
                               f"{S.MAX_METADATA_BYTES - METADATA_ROOM:,} the .colibri metadata section leaves them",
                               field="tokenizer", value=len(raw))
