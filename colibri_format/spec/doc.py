"""Render the spec's field tables as Markdown (docs/spec.md embeds them; a test keeps both in step)."""

from __future__ import annotations

import re

from .structs import DENSE_ENTRY_FIELDS, HEADER_FIELDS, WSIT_ENTRY_FIELDS, Field

_SCALARS = {"H": "uint16", "I": "uint32", "Q": "uint64"}
TABLES = {"header": HEADER_FIELDS, "dense-entry": DENSE_ENTRY_FIELDS, "wsit-entry": WSIT_ENTRY_FIELDS}


def c_type(f: Field) -> str:
    m = re.fullmatch(r"(\d*)([sHIQ])", f.code)
    count, code = (int(m.group(1)) if m.group(1) else 1), m.group(2)
    if code == "s":
        return f"char[{count}]" if f.name in ("magic", "name") else f"uint8[{count}]"
    return _SCALARS[code] if count == 1 else f"{_SCALARS[code]}[{count}]"


def field_table(fields: tuple[Field, ...]) -> str:
    rows = ["| offset | size | type | field | meaning |", "| ---: | ---: | --- | --- | --- |"]
    pos = 0
    for f in fields:
        rows.append(f"| {pos} | {f.size} | `{c_type(f)}` | `{f.name}` | {f.doc} |")
        pos += f.size
    return "\n".join(rows)


LIMIT_NAMES = ("HEADER_SIZE", "BLOB_ALIGNMENT", "ARRAY_ALIGNMENT", "SECTION_ALIGNMENT", "DATA_OFFSET",
               "DENSE_ENTRY_SIZE", "WSIT_ENTRY_SIZE", "MAX_LAYERS", "MAX_EXPERTS", "MAX_TOP_K", "MAX_WSIT_ENTRIES",
               "MAX_DENSE_TENSORS", "MAX_RANK", "MAX_DIM", "MAX_HIDDEN", "MAX_EXPERT_INTERMEDIATE",
               "MAX_NAME_LENGTH", "MAX_METADATA_BYTES", "MAX_JSON_DEPTH", "MAX_JSON_ELEMENTS", "DIM_MULTIPLE",
               "MIN_GROUP_SIZE")


def limits_table() -> str:
    from . import constants as C
    rows = ["| constant | value |", "| --- | ---: |"]
    rows += [f"| `{name}` | {getattr(C, name)} |" for name in LIMIT_NAMES]
    return "\n".join(rows)


def render_all() -> dict[str, str]:
    tables = {name: field_table(fields) for name, fields in TABLES.items()}
    tables["limits"] = limits_table()
    return tables


if __name__ == "__main__":
    for name, table in render_all().items():
        print(f"<!-- table:{name} -->\n{table}\n<!-- /table:{name} -->\n")
