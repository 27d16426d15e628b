"""docs/spec.md must show exactly the field tables and limits that colibri_format.spec implements."""

import re
from pathlib import Path

import pytest

from colibri_format.spec.doc import render_all

SPEC = Path(__file__).resolve().parents[2] / "docs" / "spec.md"


def _doc_table(text: str, name: str) -> str:
    match = re.search(rf"<!-- table:{name} -->\n(.*?)\n<!-- /table:{name} -->", text, re.S)
    assert match, f"docs/spec.md lacks the generated table {name!r}"
    return match.group(1)


@pytest.mark.parametrize("name", sorted(render_all()))
def test_spec_tables_match_code(name):
    assert _doc_table(SPEC.read_text(), name) == render_all()[name], (
        f"table {name!r} in docs/spec.md drifted from the code; regenerate with "
        "`python -m colibri_format.spec.doc`")


def test_minimal_reader_example_runs(tmp_path):
    from colibri_format.synthetic import write_synthetic
    path = str(tmp_path / "m.colibri")
    write_synthetic(path)
    code = re.search(r"```python\n(.*?)```", SPEC.read_text(), re.S).group(1)
    scope = {"path": path}
    exec(code, scope)  # the example asserts every blob's checksum
    assert scope["j"] + 1 == 2 * 4
