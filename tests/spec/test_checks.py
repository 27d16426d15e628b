"""`spec.checks.check_disjoint`: regions inside the file and pairwise disjoint, in one sorted pass."""

from __future__ import annotations

import pytest

from colibri_format.errors import ColibriFormatError, LayoutError
from colibri_format.spec.checks import Region, check_disjoint


def _r(what: str, start: int, size: int, at: int | None = None) -> Region:
    return Region(what, start, size, f"{what}.offset", at)


def test_adjacent_regions_in_any_order_and_empty_ones_pass():
    check_disjoint([_r("c", 300, 100), _r("a", 0, 100), _r("b", 100, 200), _r("empty", 50, 0)], 400)
    check_disjoint([], 0)


@pytest.mark.parametrize("regions, field, message", [
    ([_r("a", 0, 100), _r("b", 99, 10, at=7)], "b.offset", r"b at \[99, 109\) overlaps a at \[0, 100\)"),
    ([_r("c", 150, 10), _r("a", 0, 200), _r("b", 200, 10)], "c.offset", "overlaps a"),  # inside a, listed first
    ([_r("a", 0, 100), _r("b", 0, 100)], "b.offset", "overlaps a"),
    ([_r("a", 0, 100), _r("b", 350, 51)], "b.offset", r"does not lie within the file \[0, 400\)"),
    ([_r("a", -4, 8)], "a.offset", "does not lie within"),
    ([_r("a", 8, -4)], "a.offset", "does not lie within"),
])
def test_an_overlap_or_a_region_outside_the_file_is_a_layout_error(regions, field, message):
    with pytest.raises(LayoutError, match=message) as info:
        check_disjoint(regions, 400)
    bad = next(r for r in regions if r.field == field)
    assert isinstance(info.value, ColibriFormatError)
    assert (info.value.field, info.value.value, info.value.offset) == (field, bad.start, bad.at)
