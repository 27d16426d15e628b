"""`convert()`: a Hugging Face MoE checkpoint to one `.colibri` file, streaming, resumable and crash-safe.

Flow: open and normalize the checkpoint, refuse an output path that is not ours to replace
(convert/output_path.py) and a checkpoint with tensors nothing uses, plan every offset (ColibriWriter),
take the writer lock, read the journal and let the writer take over the pieces whose source and bytes still
match it, then convert the remaining pieces (dense tensors, then expert blobs) on `workers` threads, in runs
of consecutive pieces (convert/schedule.py). Each piece is streamed in row chunks (read -> check and hash the
source -> convert or quantize into the worker's write buffer -> the writer, which writes at the planned
offset and hashes), so memory stays at a few chunks and one write buffer per worker whatever the model size;
a run's buffer is written out before its pieces count as done. Completed pieces are made durable in batches:
fsync(.part), then journal records, then fsync(journal). Last: re-hash the whole `.part` against the
checksums, check the output path once more, write the sections and header, fsync, rename over the
destination, fsync the folder.

Everything that can be checked without converting is checked before the first piece: the checkpoint's
shards and headers (convert/source.py), the dtypes of the tensors read, the tokenizer files and the size of
the metadata. A refusal after that keeps the `.part` and its journal only when a resume can reuse them, and
says so; otherwise it removes them (`_after_refusal`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from colibri_format import spec as S
from colibri_format.convert import crashpoint, describe, layout, schedule
from colibri_format.convert.adapters import get_adapter
from colibri_format.convert.derived import packed_provenance
from colibri_format.convert.emit import ErrorStats, Filled, fill_dense, fill_expert
from colibri_format.convert.journal import (Journal, JournalState, WriterLock, journal_path_for, lock_path_for,
                                            read_journal)
from colibri_format.convert.layout import RowSpan
from colibri_format.convert.output_path import check_output_path, source_file_ids
from colibri_format.convert.rows import source_digest, span_bytes
from colibri_format.convert.source import PT_INDEX, ST_INDEX, open_checkpoint
from colibri_format.convert.tokenizer_files import check_token_ids
from colibri_format.convert.verify import keep_journaled_pieces, verify_all
from colibri_format.errors import (ColibriFormatError, InvalidInput, NonFiniteWeight, OutputPathRefused, ResumeError,
                                   UnsupportedModel, UnusedTensors, WriteError)
from colibri_format.fsutil import unlink_if_ours
from colibri_format.writer import ColibriWriter, PieceKey

DTYPES = ("float16", "bfloat16", "float32")
SOURCE_DTYPES = ("float32", "float16", "bfloat16", "float64")  # what a checkpoint tensor may hold
QUANTIZE_MODES = ("expert", "none", "mxfp4")
QUANT_BITS = (8, 4)                  # --quantize expert: int8 (row or group) or int4_group
DEFAULT_INT4_GROUP = 32
MAX_WORKERS = 64
UNUSED_NAMES_SHOWN = 5
# What the converter reads beside the weight files (an output path may never be one of them).
SOURCE_METADATA_FILES = ("config.json", ST_INDEX, PT_INDEX, *describe.TOKENIZER_FILES)

# progress(done_pieces, total_pieces, done_source_bytes, total_source_bytes); called on the caller's thread
Progress = Callable[[int, int, int, int], None]


@dataclass
class ConversionSummary:
    output_path: str
    architecture: str
    expert_format: str
    dense_dtype: str
    dense_tensors: int
    experts: int
    pieces_resumed: int
    bytes_in: int
    bytes_out: int
    seconds: float
    workers: int
    quant_error_max: float | None
    quant_error_mean: float | None
    read_back: bool                        # every piece re-read from the file and re-hashed before the rename

    @property
    def gb_per_s(self) -> float:
        return self.bytes_in / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gb_per_s": self.gb_per_s}


@dataclass(frozen=True)
class Options:
    dtype: str
    quantize: str
    quant_bits: int
    group_size: int | None
    workers: int
    allow_non_finite: bool = False
    allow_unused_tensors: bool = False
    scale_search: bool = False             # int4: per-group scales of least squared error (quantize_int4_into)

    @property
    def expert_format(self) -> S.ExpertFormat:
        if self.quantize == "none":
            return S.ExpertFormat(int(S.DTYPE_NAMES[self.dtype]))  # F32/F16/BF16 share their numbers
        if self.quantize == "mxfp4":
            return S.ExpertFormat.MXFP4
        if self.quant_bits == 4:
            return S.ExpertFormat.INT4_GROUP
        return S.ExpertFormat.INT8_ROW if self.group_size is None else S.ExpertFormat.INT8_GROUP

    def journal_options(self) -> dict[str, Any]:
        # workers change nothing in the output, so a resume may use another count; the allow_* flags
        # neither (a piece holding non-finite values says so in its own journal record)
        options = {"dtype": self.dtype, "quantize": self.quantize, "quant_bits": self.quant_bits,
                   "group_size": self.group_size}
        if self.scale_search:       # only when set: a journal written before the option existed still matches
            options["scale_search"] = True
        return options


@dataclass(frozen=True)
class Piece:
    """One unit of work: a dense tensor (`key` = name) or an expert blob (`key` = (layer, expert)).

    `rows` maps each matrix the piece is made of ("dense", or the blob's "gate_up" and "down") to its
    source rows.
    """

    key: PieceKey
    source_bytes: int
    rows: dict[str, tuple[RowSpan, ...]]

    @property
    def is_dense(self) -> bool:
        return isinstance(self.key, str)


@dataclass
class Job:
    """Everything planned before the first byte is written."""

    src: Any
    architecture: str
    model: dict[str, Any]
    options: Options
    pieces: list[Piece]
    tokenizer: dict[str, Any] | None
    header: dict[str, Any]
    skipped: dict[str, str] = field(default_factory=dict)  # checkpoint tensors left out on purpose -> why
    unused: list[str] = field(default_factory=list)  # tensors nothing uses, accepted by allow_unused_tensors
    sources: dict[tuple[int, int], str] = field(default_factory=dict)  # (dev, inode) -> checkpoint file name

    def piece(self, key: PieceKey) -> Piece:
        return self._pieces_by_key[key]

    def __post_init__(self) -> None:
        self._pieces_by_key = {p.key: p for p in self.pieces}
        # the checkpoint tensors stored as dense tensors (always a float dtype, whatever the expert format)
        self.dense_sources = {span.hf_name for p in self.pieces if p.is_dense for span in p.rows["dense"]}


@dataclass
class Progressive:
    """Counters of the running job (main thread only)."""

    stats: dict[tuple[int, int], ErrorStats] = field(default_factory=dict)
    bytes_in: int = 0
    done: int = 0


# --- options and planning ---------------------------------------------------------------------------
def check_options(dtype: str, quantize: str, quant_bits: int | None, group_size: int | None, workers: int, *,
                  allow_non_finite: bool = False, allow_unused_tensors: bool = False,
                  scale_search: bool = False) -> Options:
    """The options, checked and normalized: quant_bits None is 8 (4 for mxfp4), an int4 group size None is 32."""
    if dtype not in DTYPES:
        raise InvalidInput(f"--dtype must be one of {', '.join(DTYPES)}", field="dtype", value=dtype)
    if quantize not in QUANTIZE_MODES:
        raise InvalidInput(f"--quantize must be one of {', '.join(QUANTIZE_MODES)}", field="quantize", value=quantize)
    if quant_bits is None:
        quant_bits = 4 if quantize == "mxfp4" else 8
    if isinstance(quant_bits, bool) or quant_bits not in QUANT_BITS:
        raise InvalidInput("--quant-bits must be 8 (int8 experts) or 4 (int4_group experts)", field="quant_bits",
                           value=quant_bits)
    if quantize == "none" and quant_bits != 8:
        raise InvalidInput("--quant-bits needs --quantize expert", field="quant_bits", value=quant_bits)
    if quantize == "mxfp4" and quant_bits != 4:
        raise InvalidInput("--quantize mxfp4 stores 4-bit experts: --quant-bits must be 4 or left out",
                           field="quant_bits", value=quant_bits)
    if group_size is not None and quantize == "none":
        raise InvalidInput("--group-size needs --quantize expert", field="group_size", value=group_size)
    if quantize == "expert" and quant_bits == 4:
        group_size = DEFAULT_INT4_GROUP if group_size is None else group_size
        if isinstance(group_size, bool) or group_size not in S.INT4_GROUP_SIZES:
            raise InvalidInput(f"int4 experts take --group-size {', '.join(map(str, S.INT4_GROUP_SIZES))}",
                               field="group_size", value=group_size)
    if quantize == "mxfp4":
        if group_size not in (None, S.MXFP4_GROUP_SIZE):
            raise InvalidInput(f"mxfp4 experts have one scale per {S.MXFP4_GROUP_SIZE} inputs: --group-size must be "
                               f"{S.MXFP4_GROUP_SIZE} or left out", field="group_size", value=group_size)
        group_size = S.MXFP4_GROUP_SIZE
    if scale_search and not (quantize == "expert" and quant_bits == 4):
        raise InvalidInput("--scale-search chooses int4 scales: it needs --quant-bits 4", field="scale_search",
                           value=scale_search)
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
        raise InvalidInput(f"--workers must be in [1, {MAX_WORKERS}]", field="workers", value=workers)
    return Options(dtype, quantize, quant_bits, group_size, workers, allow_non_finite, allow_unused_tensors,
                   bool(scale_search))


def check_expert_counts(model: dict[str, Any], num_experts: int | None, top_k: int | None) -> None:
    if num_experts is not None and num_experts != model["num_experts"]:
        raise InvalidInput(f"--num-experts {num_experts} does not match config.json ({model['num_experts']} experts)",
                           field="num_experts", value=num_experts)
    if top_k is not None and top_k != model["top_k"]:
        raise InvalidInput(f"--top-k {top_k} does not match config.json (top_k {model['top_k']})",
                           field="top_k", value=top_k)


def plan_job(src: Any, options: Options, num_experts: int | None, top_k: int | None) -> Job:
    adapter = get_adapter(src.config.model_type)
    model = adapter.normalize_config(src.config.raw)
    src = adapter.source(src)  # FP8 / MXFP4 weights dequantized as they are read (convert/derived.py)
    check_expert_counts(model, num_experts, top_k)
    check_token_ids(dict(src.config.raw), "config.json", model["vocab_size"])
    pieces = []
    for t in layout.dense_tensors(src, model, adapter.names):
        pieces.append(Piece(t.name, span_bytes(src, (t.span,)), {"dense": (t.span,)}))
    for layer in model["moe_layers"]:
        for e in range(model["num_experts"]):
            spans = layout.expert_spans(src, model, adapter.names, layer, e)
            pieces.append(Piece((layer, e), span_bytes(src, spans.gate_up) + span_bytes(src, spans.down),
                                {"gate_up": spans.gate_up, "down": spans.down}))
    skipped, unused = _unused_tensors(src, model, adapter, pieces, options.allow_unused_tensors)
    _check_source_dtypes(src, pieces)
    if options.expert_format == S.ExpertFormat.MXFP4:
        _check_mxfp4_sources(src, pieces)
    tokenizer, tok_hashes = describe.read_tokenizer(Path(src.root), model["vocab_size"])
    header = describe.journal_header(describe.input_fingerprint(src, tok_hashes), options.journal_options())
    job = Job(src, adapter.model_type, model, options, pieces, tokenizer, header, skipped, unused)
    _check_metadata_room(job)
    return job


def _check_source_dtypes(src: Any, pieces: list[Piece]) -> None:
    """Every tensor a piece reads holds floats (an FP8 or integer weight would otherwise be refused only when
    its piece is reached, after the pieces before it were converted)."""
    for name in sorted({span.hf_name for p in pieces for spans in p.rows.values() for span in spans}):
        dtype = src.dtype(name)
        if dtype not in SOURCE_DTYPES:
            raise UnsupportedModel(f"tensor {name!r} is stored as {dtype}; only {', '.join(SOURCE_DTYPES)} weights "
                                   "can be converted", field=name, value=dtype)


def _check_mxfp4_sources(src: Any, pieces: list[Piece]) -> None:
    """mxfp4 experts are the checkpoint's own MXFP4 bytes, copied: every expert matrix must be stored as MXFP4
    (`*_blocks` / `*_scales`, quantization_config quant_method mxfp4), refused before the first piece otherwise."""
    is_mxfp4 = getattr(src, "is_mxfp4", lambda _: False)
    for name in sorted({span.hf_name for p in pieces if not p.is_dense for spans in p.rows.values() for span in spans}):
        if not is_mxfp4(name):
            raise UnsupportedModel(f"--quantize mxfp4 copies the experts of an MXFP4 checkpoint (*_blocks / *_scales); "
                                   f"{name!r} is not MXFP4 ({src.dtype(name)}): --quant-bits 4 quantizes it to "
                                   "int4_group", field=name, value=src.dtype(name))


# Stands in for each expert's quantization error when the metadata is sized before converting: as long as any
# float's repr (a real error is a shorter number).
_WIDEST_FLOAT = -2.2250738585072014e-308


def metadata_size_bound(job: Job) -> int:
    """At least the size of the metadata the job will write: built now with placeholder quantization errors as
    wide as any float's repr."""
    run = Progressive()
    if job.options.expert_format in S.QUANTIZED_FORMATS:
        run.stats = {p.key: ErrorStats(_WIDEST_FLOAT, _WIDEST_FLOAT, 1) for p in job.pieces if not p.is_dense}
    return len(S.encode_metadata(_metadata(job, run)))


def _check_metadata_room(job: Job) -> None:
    """The file's metadata (model, tokenizer, quantization errors, provenance) must fit the metadata section:
    checked here, before converting, rather than at finalize."""
    size = metadata_size_bound(job)
    if size > S.MAX_METADATA_BYTES:
        tokenizer = len(S.encode_metadata(job.tokenizer)) if job.tokenizer else 0
        raise InvalidInput(f"the .colibri metadata would take {size:,} bytes ({tokenizer:,} of them the tokenizer "
                           f"files), over the {S.MAX_METADATA_BYTES:,}-byte limit of the metadata section",
                           field="metadata_size", value=size)


def _unused_tensors(src: Any, model: dict[str, Any], adapter: Any, pieces: list[Piece], allow: bool
                    ) -> tuple[dict[str, str], list[str]]:
    """(tensors left out on purpose -> why, tensors nothing uses); the latter is an UnusedTensors error
    unless `allow` (a config with fewer layers than the weights would otherwise drop them silently)."""
    used = {span.hf_name for p in pieces for spans in p.rows.values() for span in spans}
    rest = [name for name in src.tensor_names() if name not in used]
    skipped = layout.skipped_on_purpose(rest, layout.skip_rules(model, src.config.raw, adapter.names))
    unused = [name for name in rest if name not in skipped]
    if unused and not allow:
        shown = ", ".join(unused[:UNUSED_NAMES_SHOWN])
        more = f" and {len(unused) - UNUSED_NAMES_SHOWN} more" if len(unused) > UNUSED_NAMES_SHOWN else ""
        raise UnusedTensors(f"{len(unused)} checkpoint tensors would be dropped, nothing in the "
                            f"{adapter.model_type} conversion uses them: {shown}{more} (does config.json match the "
                            "weights?); pass --allow-unused-tensors to convert without them",
                            field="tensors", value=len(unused))
    return skipped, unused


# --- public entry point -----------------------------------------------------------------------------
def convert(model_path: str | os.PathLike, output_path: str | os.PathLike, *, dtype: str = "float16",
            quantize: str = "expert", quant_bits: int | None = None, group_size: int | None = None,
            num_experts: int | None = None, top_k: int | None = None, workers: int = 2, resume: bool = True,
            verify: bool = False, progress: Progress | None = None, allow_pickle: bool = False, force: bool = False,
            allow_unused_tensors: bool = False, allow_non_finite: bool = False,
            scale_search: bool = False) -> ConversionSummary:
    """Convert a checkpoint folder to `output_path`. `resume=False` discards a previous partial run.
    Experts: `quantize="expert"` with `quant_bits` 8 (default; int8_row, or int8_group with `group_size`) or 4
    (int4_group, `group_size` 32 (default), 64 or 128; `scale_search`: each group's scale of least squared error
    instead of max|w| / 7); `quantize="mxfp4"` copies an MXFP4 checkpoint's experts
    bit for bit; `quantize="none"` stores them in `dtype`.
    `allow_pickle` lets a checkpoint without safetensors be read from `pytorch_model*.bin`
    (`torch.load(weights_only=True, mmap=True)`). An existing `.colibri` at `output_path` is replaced only
    with `force`; anything else there (another file, a checkpoint file, a symlink) is always refused.
    `allow_unused_tensors` converts a checkpoint holding tensors nothing uses (listed in the provenance);
    `allow_non_finite` stores NaN/inf and float16 overflow in float tensors instead of refusing them.
    `verify` reads every piece back from the file and re-hashes it before the rename. It is off by default because
    it doubles the disk traffic (with direct I/O the read-back goes to the device, which bounds the conversion) and
    the same check runs later anyway: `colibri validate` re-hashes the whole file, and every engine checks each
    expert's and tensor's checksum on first use (`verify="first-use"`). The checksums are computed from the bytes
    handed to the writes either way, and a resume re-hashes every piece it reuses."""
    options = check_options(dtype, quantize, quant_bits, group_size, workers, allow_non_finite=allow_non_finite,
                            allow_unused_tensors=allow_unused_tensors, scale_search=scale_search)
    dest = Path(output_path)
    if dest.is_dir() and not dest.is_symlink():
        raise InvalidInput("--output-path is a directory; give a file name", field="output_path", value=str(dest))
    if not dest.parent.is_dir():
        raise InvalidInput("the output folder does not exist", field="output_path", value=str(dest.parent))
    start = time.perf_counter()
    with open_checkpoint(model_path, allow_pickle=allow_pickle) as src:
        sources = source_file_ids(Path(src.root), [f.name for f in src.files] + list(SOURCE_METADATA_FILES))
        check_output_path(dest, sources, force=force)
        job = plan_job(src, options, num_experts, top_k)
        job.sources = sources
        lock = WriterLock(lock_path_for(dest))
        lock.acquire()
        try:
            return _convert_locked(job, dest, resume, verify, progress, start, force)
        finally:
            lock.release()


def _convert_locked(job: Job, dest: Path, resume: bool, verify: bool, progress: Progress | None,
                    start: float, force: bool) -> ConversionSummary:
    journal_file = journal_path_for(dest)
    state = read_journal(journal_file) if resume else JournalState(None, [])
    if state.header is not None:
        why = describe.header_difference(state.header, job.header)
        if why is not None:
            raise ResumeError(f"cannot resume the partial conversion of {dest.name}: {why} since it was "
                              "started; run again with --restart to start over", field="journal")
    resuming = state.header is not None
    writer = ColibriWriter(dest, job.model, dense_dtype=S.DTYPE_NAMES[job.options.dtype],
                           expert_format=job.options.expert_format, group_size=job.options.group_size or 0,
                           resume=resuming, before_piece_write=lambda: crashpoint.hit("data-write"))
    journal: Journal | None = None
    try:
        writer.check_free_space(len(S.encode_metadata(job.tokenizer)) if job.tokenizer else 0)
        writer.allocate_data_region()
        kept = keep_journaled_pieces(writer, state.pieces, job.options.workers,
                                     lambda key: source_digest(job.src, job.piece(key).rows),
                                     job.options.allow_non_finite) if resuming else []
        journal = Journal(journal_file, job.header, kept)
        run = Progressive()
        _restore_stats(run, kept)
        todo = [p for p in job.pieces if p.key not in writer.checksums]
        _convert_pieces(job, writer, journal, run, todo, progress, read_back=verify)
        if verify:
            verify_all(writer, job.options.workers)
        metadata = _metadata(job, run)
        check_output_path(dest, job.sources, force=force)  # again: something may have appeared meanwhile
        crashpoint.hit("finalize")
        _finalize(writer, metadata, lambda: check_output_path(dest, job.sources, force=force))
        crashpoint.hit("journal-remove")
        journal.remove()
        return _summary(job, dest, writer, run, len(kept), time.perf_counter() - start, verify)
    except ColibriFormatError as exc:
        _after_refusal(exc, job, writer, journal, state, journal_file)
        raise
    finally:
        if journal is not None:
            journal.close()
        writer.abort(remove_part=False)


# --- after a refusal --------------------------------------------------------------------------------
def _resume_helps(exc: ColibriFormatError, job: Job) -> bool:
    """Whether a run after this refusal can reuse the pieces already written: after a disk or I/O failure
    (disk full, file size limit, a failed fsync or read-back), something that appeared at the output path, or a
    NaN/inf that --allow-non-finite will store (float storage; the journal does not record the allow_* flags).
    Any other refusal is mended by editing the checkpoint or changing an option, which the journal's
    fingerprint sees: its pieces could never be reused."""
    if isinstance(exc, (WriteError, OutputPathRefused)):
        return True
    if isinstance(exc, NonFiniteWeight) and not job.options.allow_non_finite:
        return job.options.quantize == "none" or exc.field in job.dense_sources
    return False


def _after_refusal(exc: ColibriFormatError, job: Job, writer: ColibriWriter, journal: Journal | None,
                   state: JournalState, journal_file: Path) -> None:
    """Keep the `.part` and its journal when a resume can reuse what they hold, and say so in the message;
    otherwise remove them (only the very files this run opened or read: never one put there meanwhile)."""
    durable = journal.pieces if journal is not None else len(state.pieces)
    if durable and _resume_helps(exc, job):
        _add_note(exc, f"{durable} converted pieces are kept ({writer.part_path.name}, {journal_file.name}): run "
                       "the same command again to resume, or add --restart to start over")
        return
    writer.abort(remove_part=True)
    if journal is not None:
        journal.remove()
    elif state.ident is not None:
        unlink_if_ours(journal_file, state.ident)  # an earlier run's journal, listing nothing a resume could use


def _add_note(exc: ColibriFormatError, note: str) -> None:
    """Append `note` to the message, before its `(field=..., value=...)` tail."""
    text, tail = str(exc), exc._render("").strip()
    bare = text[:-len(tail)].rstrip() if tail and text.endswith(tail) else text
    exc.args = (f"{bare}; {note}" + (f" {tail}" if tail else ""),)


def _finalize(writer: ColibriWriter, metadata: dict[str, Any], before_rename: Callable[[], None]) -> None:
    try:
        writer.finalize(metadata, before_rename)
    except OSError as exc:  # e.g. EFBIG when sizing the file for its tables under a file size limit
        raise WriteError(f"cannot finish {writer.part_path.name}: {os.strerror(exc.errno or 5)}",
                         field="finalize") from None


def _restore_stats(run: Progressive, records: list[dict[str, Any]]) -> None:
    """The quantization error of experts an earlier run wrote, as its journal recorded it."""
    for r in records:
        if r["kind"] == "expert" and r.get("error") is not None:
            run.stats[(r["layer"], r["expert"])] = ErrorStats(float(r["error"][0]), float(r["error"][1]), 1)


# --- the work ---------------------------------------------------------------------------------------
def _do_run(job: Job, writer: ColibriWriter, run: list[Piece], read_back: bool = False) -> list[tuple[Piece, Filled]]:
    """Convert a run of pieces through this thread's write buffer and write it out. On an error, the pieces
    whose bytes did reach the file (the buffer is written out first) are handed on with it (PartialRun).
    `read_back` (the final verify will run): with direct I/O, the pieces are re-read as soon as they are written."""
    done = []
    try:
        for piece in run:
            done.append(_do_piece(job, writer, piece))
        writer.flush()
        if read_back:
            writer.read_back_later([p.key for p, _ in done])
    except BaseException as exc:
        with contextlib.suppress(Exception):
            writer.flush()  # the pieces finished before the error; a failed write counts none of them
        written = [(p, f) for p, f in done if writer.checksums.get(p.key) == f.checksum]
        if written:
            raise schedule.PartialRun(written, exc) from None
        raise
    return done


def _do_piece(job: Job, writer: ColibriWriter, piece: Piece) -> tuple[Piece, Filled]:
    stream = writer.stream(piece.key, buffered=True)
    allow = job.options.allow_non_finite
    if piece.is_dense:
        return piece, fill_dense(stream, writer.dense_dtype, job.src, piece.rows["dense"], allow_non_finite=allow)
    return piece, fill_expert(stream, writer.plan.blob, job.src, piece.rows, allow_non_finite=allow,
                              scale_search=job.options.scale_search)


def _record(piece: Piece, filled: Filled) -> dict[str, Any]:
    common = {"checksum": filled.checksum, "source": filled.source}
    if filled.non_finite:
        common["non_finite"] = True
    if piece.is_dense:
        return {"kind": "dense", "name": piece.key, **common}
    stats = filled.stats
    error = None if stats is None else [stats.max_rel, stats.mean_rel]
    return {"kind": "expert", "layer": piece.key[0], "expert": piece.key[1], **common, "error": error}


def _convert_pieces(job: Job, writer: ColibriWriter, journal: Journal, run: Progressive,
                    todo: list[Piece], progress: Progress | None, read_back: bool = False) -> None:
    batch = schedule.Batch(writer.sync, journal)
    total_bytes = sum(p.source_bytes for p in todo)

    def done(results: list[tuple[Piece, Filled]]) -> None:
        for piece, filled in results:
            if filled.stats is not None:
                run.stats[piece.key] = filled.stats
            run.bytes_in += piece.source_bytes
            run.done += 1
            batch.add(_record(piece, filled), piece.source_bytes)
        if progress and results:
            progress(run.done, len(todo), run.bytes_in, total_bytes)

    if progress:
        progress(0, len(todo), 0, total_bytes)
    try:
        schedule.run_bounded(schedule.runs(todo, lambda p: p.source_bytes),
                             lambda r: _do_run(job, writer, r, read_back), job.options.workers, done)
    except BaseException:
        # Whatever finished is made durable even on Ctrl-C or a write error, so a resume skips it; the
        # original error is the one reported. A failed fsync journals nothing (fsync errors are not retried).
        with contextlib.suppress(Exception):
            batch.flush()
        raise
    batch.flush()


# --- finishing --------------------------------------------------------------------------------------
def _per_expert(run: Progressive) -> list[list[Any]]:
    return [[layer, e, s.max_rel, s.mean_rel] for (layer, e), s in sorted(run.stats.items())]


def _metadata(job: Job, run: Progressive) -> dict[str, Any]:
    quant = describe.quantization_block(job.options.expert_format, job.options.dtype, job.options.group_size or 0,
                                        _per_expert(run))
    if job.options.scale_search:
        quant["scale_search"] = "least_squares"     # informative: how the int4 scales were chosen
    requantized = sum(1 for s in run.stats.values() if s.max_rel != 0.0)
    source_quant = packed_provenance(job.src, quant["experts"], job.options.group_size, requantized)
    return describe.build_metadata(architecture=job.architecture, model=job.model, quantization=quant,
                                   provenance_block=describe.provenance(job.src, job.skipped, job.unused,
                                                                        source_quant),
                                   tokenizer=job.tokenizer)


def _summary(job: Job, dest: Path, writer: ColibriWriter, run: Progressive, resumed: int,
             seconds: float, read_back: bool) -> ConversionSummary:
    rows = _per_expert(run)
    return ConversionSummary(
        output_path=str(dest), architecture=job.architecture,
        expert_format=S.EXPERT_FORMAT_NAMES[job.options.expert_format], dense_dtype=job.options.dtype,
        dense_tensors=len(writer.plan.dense), experts=len(writer.plan.blob_keys()), pieces_resumed=resumed,
        bytes_in=run.bytes_in, bytes_out=os.stat(dest).st_size, seconds=seconds, workers=job.options.workers,
        quant_error_max=max(r[2] for r in rows) if rows else None,
        quant_error_mean=sum(r[3] for r in rows) / len(rows) if rows else None, read_back=read_back)
