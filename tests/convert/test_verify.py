"""The check before the rename (convert/verify.py): pieces read back early, and the layout that makes that sound.

A piece read back right after its run's writes is not re-read at the end; that is sound only because no later write
can reach it: every piece write is bounded by the one `Slot` the tables record, and the slots, the header and the
sections are checked inside the file and pairwise disjoint before anything is written over them. A planning bug that
breaks this is refused before the rename, whatever the timing of the reads.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import colibri_format
from colibri_format import spec as S
from colibri_format.convert.pipeline import convert
from colibri_format.errors import LayoutError
from colibri_format.spec.structs import WSIT_ENTRY_FIELD_OFFSETS
from colibri_format.synthetic import synthetic_model, write_synthetic
from colibri_format.writer import ColibriWriter, Slot, part_path_for


def _no_output(out: Path) -> None:
    assert not out.exists() and not part_path_for(out).exists()


def test_overlapping_slots_from_the_planner_are_refused_before_anything_is_written(bf16_moe_checkpoint, tmp_path,
                                                                                   monkeypatch):
    """A planner that puts expert (1, 3) one page into expert (1, 2): refused when the writer is made (no `.part`
    created, nothing written), naming the WSIT entry, its offset and the piece it overlaps."""
    real_plan = S.plan_file

    class Overlapping(S.FilePlan):
        def blob_offset(self, layer: int, expert: int) -> int:
            return super().blob_offset(layer, expert) - (4096 if (layer, expert) == (1, 3) else 0)

    def plan_file(*args, **kwargs):
        plan = real_plan(*args, **kwargs)
        return Overlapping(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)})

    monkeypatch.setattr(S, "plan_file", plan_file)
    out = tmp_path / "m.colibri"
    with pytest.raises(LayoutError, match=r"expert \(1, 3\) at \[\d+, \d+\) overlaps expert \(1, 2\)") as info:
        convert(bf16_moe_checkpoint, out, workers=2)
    assert info.value.field == "wsit[9].offset"  # layers 0 and 1 of 6 experts each: entry 6 + 3
    _no_output(out)


@pytest.mark.parametrize("verify", [True, False])
def test_a_slot_moved_after_planning_is_refused_before_the_rename(bf16_moe_checkpoint, tmp_path, monkeypatch, verify):
    """Expert (0, 4)'s slot moved onto expert (0, 1)'s after the writer checked its plan (a slot allocation bug the
    plan check cannot see): the pieces are written where their slots say, and `finalize` refuses the tables before
    writing them, with or without the read-back (without it the layout check is the only one), naming the WSIT
    entry, the offset it records and where that entry would lie in the file. The `.part` is not kept for a resume
    (it would plan the same). With the read-back on, the verify step checks the slots before reading: the overlap is
    reported as what it is, not as a piece that failed to read back."""
    real_init = ColibriWriter.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        other = self._slots[(0, 1)]
        self._slots[(0, 4)] = Slot((0, 4), other.offset, other.size, self._slots[(0, 4)].seed)

    monkeypatch.setattr(ColibriWriter, "__init__", init)
    out = tmp_path / "m.colibri"
    with pytest.raises(LayoutError, match=r"expert \(0, 4\) at \[\d+, \d+\) overlaps expert \(0, 1\)") as info:
        convert(bf16_moe_checkpoint, out, workers=2, verify=verify)
    err = info.value
    assert err.field == "wsit[4].offset" and err.value > 0
    if not verify:  # finalize: where the entry would lie in the file (the verify step's check comes before the tables)
        assert (err.offset - WSIT_ENTRY_FIELD_OFFSETS["offset"][0]) % S.WSIT_ENTRY_SIZE == 0
    _no_output(out)


def test_sections_over_a_blob_are_refused_before_they_are_written(bf16_moe_checkpoint, tmp_path, monkeypatch):
    """A plan whose dense directory starts inside the last blob: `finalize` refuses before writing a section (the
    blob, read back intact long before, would otherwise be overwritten after its read-back)."""
    real_sections = S.FilePlan.sections

    def sections(self, metadata_size: int, num_dense: int):
        dir_off, wsit_off, wsit_size, file_size = real_sections(self, metadata_size, num_dense)
        shift = self.metadata_offset - 64 - dir_off
        return dir_off + shift, wsit_off + shift, wsit_size, file_size + shift

    monkeypatch.setattr(S.FilePlan, "sections", sections)
    writes = []
    real_write_sections = ColibriWriter._write_sections

    def write_sections(self, meta_raw):
        writes.append(len(meta_raw))
        return real_write_sections(self, meta_raw)

    monkeypatch.setattr(ColibriWriter, "_write_sections", write_sections)
    out = tmp_path / "m.colibri"
    with pytest.raises(LayoutError, match="overlaps") as info:
        convert(bf16_moe_checkpoint, out, workers=2)
    assert writes and info.value.field == "dense_dir_offset" and info.value.offset == 120  # the header field
    _no_output(out)


def test_the_stream_the_read_back_and_the_tables_share_one_slot(tmp_path, monkeypatch):
    """`slot(key)` is the one object: a stream is bounded by it, and the file's directory and WSIT record it."""
    slots = {}
    real_finalize = ColibriWriter.finalize

    def finalize(self, *args, **kwargs):
        for key in self.piece_keys():
            assert self.stream(key).slot is self.slot(key)
            slots[key] = (self.slot(key).offset, self.slot(key).size)
        return real_finalize(self, *args, **kwargs)

    monkeypatch.setattr(ColibriWriter, "finalize", finalize)
    path = tmp_path / "m.colibri"
    write_synthetic(path, synthetic_model(layers=2, experts=4), seed=1)
    with colibri_format.open(path) as f:
        h = f.header
    raw = path.read_bytes()
    wsit = [S.WsitEntry.unpack(raw[h.wsit_offset + k * S.WSIT_ENTRY_SIZE:][:S.WSIT_ENTRY_SIZE])
            for k in range(h.num_blobs)]
    dense = [S.DenseEntry.unpack_raw(raw[h.dense_dir_offset + k * S.DENSE_ENTRY_SIZE:][:S.DENSE_ENTRY_SIZE])
             for k in range(h.num_dense_tensors)]
    recorded = {(e.layer, e.expert): (e.offset, e.size) for e in wsit}
    recorded.update({fields[0].rstrip(b"\0").decode(): (fields[8], fields[9]) for fields in dense})
    assert slots and recorded == slots


def test_pieces_read_back_early_are_not_read_again(bf16_moe_checkpoint, tmp_path, monkeypatch):
    """With direct I/O every piece is read back right after its run, and the end-of-job pass re-reads none of them
    (the reads after `read_back_results`, which waits for the early ones, are the end-of-job pass's)."""
    probe = ColibriWriter(tmp_path / "probe.colibri", synthetic_model(layers=2, experts=4), dense_dtype=S.DType.F16,
                          expert_format=S.ExpertFormat.INT8_ROW)
    direct = probe.direct_io
    probe.abort(remove_part=True)
    if not direct:
        pytest.skip("no direct I/O under the tests' temporary folder: nothing is read back early")
    seen: dict[str, object] = {"late": []}
    real_results, real_checksum = ColibriWriter.read_back_results, ColibriWriter.checksum_on_disk

    def results(self):
        ok = real_results(self)
        seen["early"], seen["all"] = set(ok), set(self.piece_keys())
        return ok

    def checksum_on_disk(self, slot):
        if "early" in seen:
            seen["late"].append(slot.key)
        return real_checksum(self, slot)

    monkeypatch.setattr(ColibriWriter, "read_back_results", results)
    monkeypatch.setattr(ColibriWriter, "checksum_on_disk", checksum_on_disk)
    convert(bf16_moe_checkpoint, tmp_path / "m.colibri", workers=2, verify=True)
    assert seen["early"] == seen["all"] and seen["late"] == []
