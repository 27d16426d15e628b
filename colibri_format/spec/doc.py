"""Render the spec's tables as Markdown (docs/spec.md embeds them; a test keeps both in step).

    python -m colibri_format.spec.doc                       # print every table
    python -m colibri_format.spec.doc --write docs/spec.md  # replace the tables between their markers in place

Field tables come from the structs, limits from the constants, and the expert-format, element-type and
blob-array tables from the constants and `layout.blob_array_specs` (evaluated on symbols, so the shapes shown
are the ones the layout code computes).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from . import constants as C
from .layout import blob_array_specs
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
               "MIN_GROUP_SIZE", "INT4_GROUP_SIZES", "MXFP4_GROUP_SIZE")


def limits_table() -> str:
    rows = ["| constant | value |", "| --- | ---: |"]
    for name in LIMIT_NAMES:
        value = getattr(C, name)
        rows.append(f"| `{name}` | {', '.join(map(str, value)) if isinstance(value, tuple) else value} |")
    return "\n".join(rows)


# --- element types and expert formats ------------------------------------------------------------------------------
DTYPE_MEANING = {
    C.DType.F32: "IEEE binary32",
    C.DType.F16: "IEEE binary16",
    C.DType.BF16: "bfloat16: the high 16 bits of a binary32",
    C.DType.I8: "two's-complement int8; expert blobs only",
    C.DType.I4X2: "one byte, two two's-complement 4-bit integers in [-8, 7]: element 2k in bits 0-3 (low nibble), "
                  "element 2k+1 in bits 4-7; expert blobs only",
    C.DType.FP4X2: "one byte, two OCP FP4 E2M1 values (bit 3 sign, bits 2-1 exponent of bias 1, bit 0 mantissa: "
                   "±{0, 0.5, 1, 1.5, 2, 3, 4, 6}): element 2k in bits 0-3 (low nibble), element 2k+1 in bits 4-7; "
                   "expert blobs only",
    C.DType.E8M0: "one byte `e`, the OCP E8M0 scale 2^(e − 127); 0xFF (NaN) MUST NOT be stored; expert blobs only",
}


def dtype_table() -> str:
    rows = ["| code | name | bytes | values |", "| ---: | --- | ---: | --- |"]
    rows += [f"| {int(d)} | {d.name} | {C.DTYPE_SIZE[d]} | {DTYPE_MEANING[d]} |" for d in C.DType]
    return "\n".join(rows)


def _bits_per_weight(fmt: C.ExpertFormat) -> str:
    bits = C.EXPERT_FORMAT_BITS[fmt]
    if fmt not in C.QUANTIZED_FORMATS:
        return str(bits)
    scale_bits = 8 * C.DTYPE_SIZE[C.SCALE_DTYPE[fmt]]
    if fmt == C.ExpertFormat.INT8_ROW:
        return f"{bits} + {scale_bits}/row length"
    if fmt == C.ExpertFormat.MXFP4:
        return f"{bits + scale_bits / C.MXFP4_GROUP_SIZE:g}"
    return f"{bits} + {scale_bits}/g"


def _group_rule(fmt: C.ExpertFormat) -> str:
    if fmt == C.ExpertFormat.INT8_GROUP:
        return f"a multiple of {C.DIM_MULTIPLE} dividing H and I"
    if fmt == C.ExpertFormat.INT4_GROUP:
        return f"{', '.join(map(str, C.INT4_GROUP_SIZES))}, dividing H and I"
    if fmt == C.ExpertFormat.MXFP4:
        return f"{C.MXFP4_GROUP_SIZE}, dividing H and I"
    return "0"


def expert_format_table() -> str:
    rows = ["| code | name | matrix elements | scales | `group_size` g | bits per weight | since |",
            "| ---: | --- | --- | --- | --- | --- | --- |"]
    for fmt in C.ExpertFormat:
        scale = C.SCALE_DTYPE.get(fmt)
        per = "row" if fmt == C.ExpertFormat.INT8_ROW else f"{C.MXFP4_GROUP_SIZE} inputs" \
            if fmt == C.ExpertFormat.MXFP4 else "g inputs"
        rows.append(f"| {int(fmt)} | `{C.EXPERT_FORMAT_NAMES[fmt]}` | {C.EXPERT_FORMAT_DTYPE[fmt].name} | "
                    f"{'-' if scale is None else f'{scale.name}, one per {per}'} | {_group_rule(fmt)} | "
                    f"{_bits_per_weight(fmt)} | {C.VERSION_MAJOR}.{C.MINOR_VERSION_OF[fmt]} |")
    return "\n".join(rows)


class _Sym(str):
    """A dimension written as a symbol: `2 * _Sym("I")` is "2I", `_Sym("H") // 2` is "H/2"."""

    def __rmul__(self, k: int) -> _Sym:
        return _Sym(f"{k}{self}")

    def __floordiv__(self, d) -> _Sym:
        return self if d == 1 else _Sym(f"{self}/{d}")


def blob_array_table() -> str:
    names = ("gate_up", "gate_up_scale", "down", "down_scale")
    rows = ["| expert format | " + " | ".join(f"`{n}`" for n in names) + " |", "| --- |" + " --- |" * len(names)]
    for fmt in C.ExpertFormat:
        group = C.MXFP4_GROUP_SIZE if fmt == C.ExpertFormat.MXFP4 else _Sym("g")
        specs = {name: (shape, dtype) for name, shape, dtype in blob_array_specs(_Sym("H"), _Sym("I"), fmt, group)}
        cells = [f"`[{specs[n][0][0]}, {specs[n][0][1]}]` {specs[n][1].name}" if n in specs else "-" for n in names]
        rows.append(f"| `{C.EXPERT_FORMAT_NAMES[fmt]}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def render_all() -> dict[str, str]:
    tables = {name: field_table(fields) for name, fields in TABLES.items()}
    tables["limits"] = limits_table()
    tables["dtypes"] = dtype_table()
    tables["expert-formats"] = expert_format_table()
    tables["blob-arrays"] = blob_array_table()
    return tables


def replace_tables(text: str, tables: dict[str, str]) -> str:
    """`text` with the body between each `<!-- table:NAME -->` / `<!-- /table:NAME -->` pair replaced."""
    for name, table in tables.items():
        pattern = re.compile(rf"(<!-- table:{name} -->\n)(?:.*?\n)?(<!-- /table:{name} -->)", re.S)
        if not pattern.search(text):
            raise KeyError(f"no <!-- table:{name} --> markers in the document")
        text = pattern.sub(lambda m: m.group(1) + table + "\n" + m.group(2), text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render (or rewrite in place) the generated tables of docs/spec.md.")
    parser.add_argument("--write", type=Path, help="a Markdown file whose marked tables are replaced in place")
    args = parser.parse_args(argv)
    if args.write is None:
        for name, table in render_all().items():
            print(f"<!-- table:{name} -->\n{table}\n<!-- /table:{name} -->\n")
        return 0
    args.write.write_text(replace_tables(args.write.read_text(), render_all()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
