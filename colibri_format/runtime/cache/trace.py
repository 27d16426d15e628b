"""Routing traces: which experts the router chose, per token and MoE layer, as JSON Lines.

Format (version 1), UTF-8, one JSON object per line:

* line 1, the header::

    {"colibri_trace": 1, "num_layers": 16, "moe_layers": [0, 1, ...], "num_experts": 64, "top_k": 8,
     "model": "olmoe"}

* then one line per routed token::

    {"t": 0, "seq": 0, "pos": 5, "experts": [[0, [12, 3]], [1, [40, 7]]]}

  ``t`` is the forward-pass index (the engine's step; a prefill pass over P prompt tokens writes P
  lines with the same ``t``), never decreasing from line to line. ``seq`` is the sequence's index in
  the batch, ``pos`` (optional) the token's position in its sequence. ``experts`` lists
  ``[layer, [expert, ...]]`` for MoE layers in ascending order, each at most once, with at most
  ``top_k`` distinct experts in router order.

The cache replays a trace as a sequence of ``(layer, expert)`` accesses (:func:`access_sequence`):
forward pass by forward pass, MoE layer by MoE layer, and within a layer by first appearance. With
``dedup=True`` (the default, what the engines do) an expert chosen by several tokens of one forward
pass is one access, because the engine loads it once for all of them.

:func:`read_trace` treats the file as untrusted: size caps, exact types, ids in range, line numbers in
every error.
"""

from __future__ import annotations

import json
import os
import stat
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any, NamedTuple

import numpy as np

from colibri_format.errors import InvalidInput, OutputPathRefused, WriteError
from colibri_format.runtime.cache.expert_cache import SCOPES

TRACE_VERSION = 1
MAX_TRACE_BYTES = 4 << 30       # whole file
MAX_LINE_BYTES = 1 << 20        # one line
MAX_LAYERS = 4096
MAX_EXPERTS = 1 << 16
MAX_TOP_K = 1024
MAX_INDEX = (1 << 53) - 1       # t, seq, pos


@dataclass(frozen=True)
class TraceHeader:
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    model: str

    def to_json(self) -> dict[str, Any]:
        return {"colibri_trace": TRACE_VERSION, "num_layers": self.num_layers,
                "moe_layers": list(self.moe_layers), "num_experts": self.num_experts,
                "top_k": self.top_k, "model": self.model}

    @property
    def total_experts(self) -> int:
        return len(self.moe_layers) * self.num_experts


class TraceRecord(NamedTuple):
    """One routed token: ``experts`` is ``((layer, (e, ...)), ...)``, layers ascending."""

    t: int
    seq: int
    pos: int | None
    experts: tuple[tuple[int, tuple[int, ...]], ...]


@dataclass
class Trace:
    header: TraceHeader
    records: list[TraceRecord]


@dataclass(frozen=True)
class Accesses:
    """An ordered access sequence: ``layer[i], expert[i]`` accessed during forward pass ``step[i]``
    (``step`` counts forward passes from 0 and is the token clock)."""

    layer: np.ndarray   # [N] int32
    expert: np.ndarray  # [N] int32
    step: np.ndarray    # [N] int64

    def __len__(self) -> int:
        return int(self.layer.shape[0])

    def pairs(self) -> list[tuple[int, int]]:
        return list(zip(self.layer.tolist(), self.expert.tolist()))


# --- validation helpers ---------------------------------------------------------------------------
def _fail(message: str, at: tuple[int, int] | None, value: object = None) -> InvalidInput:
    """``at`` is (line number, byte offset of that line), or None for data not read from a file."""
    if at is None:
        return InvalidInput("trace: " + message, value=value)
    return InvalidInput(f"trace line {at[0]}: {message}", field=f"line {at[0]}", value=value, offset=at[1])


def _int(value: object, name: str, lo: int, hi: int, at: tuple[int, int] | None) -> int:
    # bool is an int subclass in Python; JSON true/false must not pass as 1/0
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(f"{name} must be an integer", at, value)
    if not lo <= value <= hi:
        raise _fail(f"{name} {value} out of range [{lo}, {hi}]", at, value)
    return value


def make_header(num_layers: int, moe_layers: Iterable[int], num_experts: int, top_k: int,
                model: str = "unknown", *, at: tuple[int, int] | None = None) -> TraceHeader:
    """Build a checked :class:`TraceHeader`."""
    num_layers = _int(num_layers, "num_layers", 1, MAX_LAYERS, at)
    num_experts = _int(num_experts, "num_experts", 1, MAX_EXPERTS, at)
    top_k = _int(top_k, "top_k", 1, min(num_experts, MAX_TOP_K), at)
    if isinstance(moe_layers, (str, bytes, dict)) or not isinstance(moe_layers, Iterable):
        raise _fail("moe_layers must be a list of layer indices", at, moe_layers)
    layers = tuple(_int(x, "moe layer", 0, num_layers - 1, at) for x in moe_layers)
    if not layers:
        raise _fail("moe_layers is empty", at)
    if list(layers) != sorted(set(layers)):
        raise _fail("moe_layers must be strictly ascending", at, list(layers))
    if not isinstance(model, str) or len(model) > 256:
        raise _fail("model must be a string of at most 256 characters", at, model)
    return TraceHeader(num_layers, layers, num_experts, top_k, model)


def _check_experts(header: TraceHeader, layer: int, experts: object, at: tuple[int, int] | None) -> tuple[int, ...]:
    if not isinstance(experts, (list, tuple)):
        raise _fail(f"layer {layer}: experts must be a list", at, experts)
    if not 1 <= len(experts) <= header.top_k:
        raise _fail(f"layer {layer}: {len(experts)} experts, expected 1 to top_k={header.top_k}", at)
    out = tuple(_int(e, f"layer {layer}: expert", 0, header.num_experts - 1, at) for e in experts)
    if len(set(out)) != len(out):
        raise _fail(f"layer {layer}: repeated expert", at, list(out))
    return out


def check_shape(header: TraceHeader, model: dict[str, Any], source: str = "trace") -> None:
    """Refuse a trace recorded on a model of another shape than `model` (a file's normalized model object):
    its layers, MoE layers, experts per layer and top-k must all match."""
    expected = (("num_layers", header.num_layers, model.get("num_layers")),
                ("moe_layers", list(header.moe_layers), list(model.get("moe_layers") or [])),
                ("num_experts", header.num_experts, model.get("num_experts")),
                ("top_k", header.top_k, model.get("top_k")))
    for name, got, want in expected:
        if got != want:
            raise InvalidInput(f"{source} was recorded on a model of another shape: {name} is {_brief(got)} in the "
                               f"trace, {_brief(want)} in the file", field=f"{source}.{name}", value=got)


def _brief(value: object) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --- reading --------------------------------------------------------------------------------------
def _reject_constant(name: str) -> None:
    raise ValueError(f"non-standard JSON constant {name}")


def _parse(raw: bytes, at: tuple[int, int]) -> dict[str, Any]:
    try:
        obj = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _fail(f"not valid JSON ({exc.__class__.__name__}: {str(exc)[:100]})", at) from None
    if not isinstance(obj, dict):
        raise _fail("expected a JSON object", at)
    return obj


def _parse_header(obj: dict[str, Any]) -> TraceHeader:
    version = obj.get("colibri_trace")
    if version != TRACE_VERSION or isinstance(version, bool):
        raise _fail(f"not a colibri trace header (colibri_trace must be {TRACE_VERSION})", (1, 0), version)
    for name in ("num_layers", "moe_layers", "num_experts", "top_k"):
        if name not in obj:
            raise _fail(f"header lacks {name!r}", (1, 0))
    return make_header(obj["num_layers"], obj["moe_layers"], obj["num_experts"], obj["top_k"],
                       obj.get("model", "unknown"), at=(1, 0))


_RECORD_KEYS = frozenset({"t", "seq", "pos", "experts"})


def _parse_record(obj: dict[str, Any], header: TraceHeader, moe: frozenset[int],
                  at: tuple[int, int]) -> TraceRecord:
    extra = set(obj) - _RECORD_KEYS
    if extra:
        raise _fail(f"unknown keys {sorted(extra)[:5]}", at)
    for name in ("t", "seq", "experts"):
        if name not in obj:
            raise _fail(f"missing {name!r}", at)
    t = _int(obj["t"], "t", 0, MAX_INDEX, at)
    seq = _int(obj["seq"], "seq", 0, MAX_INDEX, at)
    pos = obj.get("pos")
    if pos is not None:
        pos = _int(pos, "pos", 0, MAX_INDEX, at)
    items = obj["experts"]
    if not isinstance(items, list) or len(items) > len(header.moe_layers):
        raise _fail(f"experts must be a list of at most {len(header.moe_layers)} [layer, [experts]] pairs",
                    at)
    experts = []
    prev = -1
    for item in items:
        if not isinstance(item, list) or len(item) != 2:
            raise _fail("each experts item must be [layer, [expert, ...]]", at, item)
        layer = _int(item[0], "layer", 0, header.num_layers - 1, at)
        if layer not in moe:
            raise _fail(f"layer {layer} is not a MoE layer", at, layer)
        if layer <= prev:
            raise _fail("layers must be ascending and appear once", at, layer)
        prev = layer
        experts.append((layer, _check_experts(header, layer, item[1], at)))
    return TraceRecord(t, seq, pos, tuple(experts))


def _read_line(fh: IO[bytes], at: tuple[int, int], max_line: int) -> bytes:
    raw = fh.readline(max_line + 1)
    if len(raw) > max_line:
        raise _fail(f"longer than {max_line} bytes", at)
    return raw


def _open_checked(path: str | os.PathLike[str], max_bytes: int) -> IO[bytes]:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise InvalidInput(f"cannot read trace: {exc.strerror}", field="path", value=str(path)) from None
    if not os.path.isfile(path):
        raise InvalidInput("trace is not a regular file", field="path", value=str(path))
    if st.st_size > max_bytes:
        raise InvalidInput(f"trace is {st.st_size} bytes, over the {max_bytes}-byte cap", field="path",
                           value=str(path))
    return open(path, "rb")


def iter_trace(path: str | os.PathLike[str], *, max_bytes: int = MAX_TRACE_BYTES,
               max_line_bytes: int = MAX_LINE_BYTES) -> tuple[TraceHeader, Iterator[TraceRecord]]:
    """(header, records one at a time): a trace read and checked line by line, never whole in memory.

    Raises (the header at once, each record as it is reached):
        InvalidInput: the file is too large or not a regular file, or a line is malformed; the
            message starts with ``trace line N:`` and ``offset`` is the byte offset of that line.
    """
    fh = _open_checked(path, max_bytes)
    try:
        raw = _read_line(fh, (1, 0), max_line_bytes)
        if not raw.strip():
            raise _fail("empty trace (no header line)", (1, 0))
        header = _parse_header(_parse(raw, (1, 0)))
    except BaseException:
        fh.close()
        raise
    return header, _records(fh, header, len(raw), max_line_bytes)


def _records(fh: IO[bytes], header: TraceHeader, offset: int, max_line_bytes: int) -> Iterator[TraceRecord]:
    moe = frozenset(header.moe_layers)
    line, last_t = 1, -1
    with fh:
        while True:
            at = (line + 1, offset)
            raw = _read_line(fh, at, max_line_bytes)
            if not raw:
                return
            line += 1
            if not raw.strip():
                raise _fail("blank line", at)
            rec = _parse_record(_parse(raw, at), header, moe, at)
            if rec.t < last_t:
                raise _fail(f"t={rec.t} goes backwards (previous line has t={last_t})", at, rec.t)
            last_t = rec.t
            offset += len(raw)
            yield rec


def read_trace(path: str | os.PathLike[str], *, max_bytes: int = MAX_TRACE_BYTES,
               max_line_bytes: int = MAX_LINE_BYTES) -> Trace:
    """Read and check a whole routing trace into memory (see :func:`iter_trace`; :func:`read_accesses` keeps
    only the compact access arrays)."""
    header, records = iter_trace(path, max_bytes=max_bytes, max_line_bytes=max_line_bytes)
    return Trace(header, list(records))


def read_accesses(path: str | os.PathLike[str], *, dedup: bool = True,
                  max_bytes: int = MAX_TRACE_BYTES) -> tuple[TraceHeader, Accesses, int]:
    """(header, global access sequence, tokens) of a trace file, streamed: memory grows with the accesses
    (16 bytes each), never with the parsed records."""
    header, records = iter_trace(path, max_bytes=max_bytes)
    counter = _Counted(records)
    return header, _accesses(counter, dedup), counter.count


class _Counted:
    def __init__(self, items: Iterator[TraceRecord]) -> None:
        self.items, self.count = items, 0

    def __iter__(self) -> Iterator[TraceRecord]:
        for item in self.items:
            self.count += 1
            yield item


# --- writing --------------------------------------------------------------------------------------
def _dump(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":")) + "\n"


def _record_json(rec: TraceRecord) -> dict[str, Any]:
    obj: dict[str, Any] = {"t": rec.t, "seq": rec.seq}
    if rec.pos is not None:
        obj["pos"] = rec.pos
    obj["experts"] = [[layer, list(es)] for layer, es in rec.experts]
    return obj


# --- opening the output: a new regular file, never the model, never through a link -----------------------
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def check_trace_path(path: str | os.PathLike[str], *, overwrite: bool = False,
                     protect: Iterable[str | os.PathLike[str]] = (), field: str = "trace",
                     option: str = "the trace path",
                     replace_hint: str = "remove it or choose another path") -> bool:
    """Refuse a path a routing trace must not be written to; True when a regular file is there to replace.

    Refused: a symbolic link (a trace is never written through one), a folder, anything not a regular file
    (a FIFO would block the writer, a device is no file), a file that is one of `protect` (the same device and
    inode, so also through a hard link: the model being run, which truncating would kill with SIGBUS), and
    without `overwrite` any existing file. `option` names the path in the messages ("--trace"), `replace_hint`
    says how to replace an existing file ("pass --force to replace it").

    Raises:
        OutputPathRefused: one of the above, naming `field` and the path.
    """
    def refuse(why: str) -> OutputPathRefused:
        return OutputPathRefused(f"{option} {why}", field=field, value=os.fspath(path))

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise refuse(f"cannot be checked: {exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise refuse("is a symbolic link; a trace is never written through one: give the real path")
    if stat.S_ISDIR(st.st_mode):
        raise refuse("is a folder; give a file name")
    if not stat.S_ISREG(st.st_mode):
        raise refuse("exists and is not a regular file (a FIFO, device or socket); give a file name")
    for other in protect:
        try:
            mine = os.stat(other)
        except OSError:
            continue
        if (mine.st_dev, mine.st_ino) == (st.st_dev, st.st_ino):
            raise refuse("is the model file being run (the same file, maybe through a link); refusing to "
                         "overwrite it")
    if not overwrite:
        raise refuse(f"already exists; {replace_hint}")
    return True


def clear_trace_path(path: str | os.PathLike[str], *, protect: Iterable[str | os.PathLike[str]] = (),
                     field: str = "trace", option: str = "the trace path") -> None:
    """Remove the regular file at `path` (after `check_trace_path` with overwrite) so that a new trace can be
    created there. Only the name goes: a process reading or mapping the old file keeps its bytes."""
    if check_trace_path(path, overwrite=True, protect=protect, field=field, option=option):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise WriteError(f"cannot replace {option}: {exc.strerror}", field=field, value=os.fspath(path)) from None


def create_trace_file(path: str | os.PathLike[str], *, overwrite: bool = False,
                      protect: Iterable[str | os.PathLike[str]] = (), field: str = "trace",
                      option: str = "the trace path") -> IO[str]:
    """A new, empty trace file at `path`, open for writing text.

    Created with O_CREAT | O_EXCL | O_NOFOLLOW: it never truncates a file in place, never follows a link and
    never blocks on a FIFO; whatever appears at the name between the checks and the creation makes it fail.
    An existing regular file is replaced (its name unlinked first) only with `overwrite`; see
    `check_trace_path` for what is refused.

    Raises:
        OutputPathRefused: the path is refused, or something appeared there meanwhile.
        WriteError: the file cannot be created (permission, missing folder, read-only disk).
    """
    protect = list(protect)
    if overwrite:
        clear_trace_path(path, protect=protect, field=field, option=option)
    else:
        check_trace_path(path, protect=protect, field=field, option=option)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644)
    except FileExistsError:
        raise OutputPathRefused(f"{option} was taken by another file while the trace was being created",
                                field=field, value=os.fspath(path)) from None
    except OSError as exc:
        raise WriteError(f"cannot create {option}: {exc.strerror}", field=field, value=os.fspath(path)) from None
    return os.fdopen(fd, "w", encoding="utf-8")


class TraceWriter:
    """Writes a trace while an engine runs.

    Call ``record(token_step, seq, layer, experts)`` for every MoE layer of every forward pass;
    ``experts`` is the router's choice for one token (``[k]``) or for the P tokens of ``seq`` in this
    pass (``[P, k]``, in position order). Repeated calls for the same ``(token_step, seq, layer)``
    continue with the next token. Lines of a forward pass are written when the next pass starts, on
    ``flush()`` or on ``close()``. Use as a context manager.

    The file is created new (see :func:`create_trace_file`): an existing file is replaced only with
    ``overwrite``, and never when it is one of ``protect`` (the model being run); a link, FIFO, device or folder
    at ``path`` is refused either way.
    """

    def __init__(self, path: str | os.PathLike[str], *, num_layers: int, moe_layers: Iterable[int],
                 num_experts: int, top_k: int, model: str = "unknown", overwrite: bool = False,
                 protect: Iterable[str | os.PathLike[str]] = ()) -> None:
        self.header = make_header(num_layers, moe_layers, num_experts, top_k, model)
        self._moe = frozenset(self.header.moe_layers)
        self._fh: IO[str] | None = create_trace_file(path, overwrite=overwrite, protect=protect)
        self._fh.write(_dump(self.header.to_json()))
        self._step: int | None = None
        self._rows: dict[int, list[dict[str, Any]]] = {}       # seq -> token rows of this pass
        self._filled: dict[tuple[int, int], int] = {}          # (seq, layer) -> rows filled

    def record(self, token_step: int, seq: int, layer: int, experts: Any, pos: int | None = None) -> None:
        step = _int(int(token_step), "token_step", 0, MAX_INDEX, None)
        seq = _int(int(seq), "seq", 0, MAX_INDEX, None)
        layer = int(layer)
        if layer not in self._moe:
            raise _fail(f"layer {layer} is not a MoE layer", None, layer)
        if self._step is not None and step < self._step:
            raise _fail(f"token_step {step} goes backwards (current {self._step})", None, step)
        if step != self._step:
            self.flush()
            self._step = step
        arr = np.asarray(experts)
        rows = arr.reshape(1, -1) if arr.ndim == 1 else arr
        if rows.ndim != 2:
            raise _fail("experts must be [k] or [P, k]", None, arr.shape)
        token_rows = self._rows.setdefault(seq, [])
        start = self._filled.get((seq, layer), 0)
        for i, chosen in enumerate(rows.tolist()):
            r = start + i
            while len(token_rows) <= r:
                token_rows.append({"pos": None, "experts": {}})
            token_rows[r]["experts"][layer] = _check_experts(self.header, layer, chosen, None)
            if pos is not None:
                token_rows[r]["pos"] = int(pos) + i
        self._filled[(seq, layer)] = start + len(rows)

    def flush(self) -> None:
        if self._fh is None:
            raise InvalidInput("trace writer is closed")
        for seq in sorted(self._rows):
            for row in self._rows[seq]:
                experts = tuple((layer, row["experts"][layer]) for layer in sorted(row["experts"]))
                self._fh.write(_dump(_record_json(TraceRecord(self._step or 0, seq, row["pos"], experts))))
        self._rows.clear()
        self._filled.clear()
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self.flush()
            self._fh.close()
            self._fh = None

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_trace(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write an in-memory :class:`Trace` (e.g. a synthetic one) to ``path``."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(_dump(trace.header.to_json()))
        for rec in trace.records:
            fh.write(_dump(_record_json(rec)))


# --- replay ---------------------------------------------------------------------------------------
def access_sequence(trace: Trace, scope: str = "global", *,
                    dedup: bool = True) -> Accesses | dict[int, Accesses]:
    """The ordered ``(layer, expert)`` accesses of a trace.

    Args:
        scope: ``global`` returns one :class:`Accesses`; ``per_layer`` a dict ``layer -> Accesses``
            holding each layer's subsequence (same order, same ``step`` values).
        dedup: one access per expert per layer per forward pass (what the engines do); False counts
            every token's choice.
    """
    if scope not in SCOPES:
        raise InvalidInput(f"unknown scope {scope!r}; expected global or per_layer", field="scope", value=scope)
    acc = _accesses(iter(trace.records), dedup)
    if scope == "global":
        return acc
    out = {}
    for layer in trace.header.moe_layers:
        mask = acc.layer == layer
        if mask.any():
            out[layer] = Accesses(acc.layer[mask], acc.expert[mask], acc.step[mask])
    return out


def _accesses(records: Iterable[TraceRecord], dedup: bool) -> Accesses:
    """Group consecutive records of one forward pass (same ``t``); per pass, MoE layers ascending, experts by
    first appearance (once each with ``dedup``). Arrays grow in compact typed buffers, not Python lists."""
    layers, experts, steps = array("i"), array("i"), array("q")
    step_index, current, per_layer = -1, None, {}

    def flush() -> None:
        for layer in sorted(per_layer):
            chosen = list(dict.fromkeys(per_layer[layer])) if dedup else per_layer[layer]
            layers.extend([layer] * len(chosen))
            experts.extend(chosen)
            steps.extend([step_index] * len(chosen))

    for rec in records:
        if rec.t != current:
            flush()
            current, per_layer, step_index = rec.t, {}, step_index + 1
        for layer, es in rec.experts:
            per_layer.setdefault(layer, []).extend(es)
    flush()
    return Accesses(np.frombuffer(layers, np.int32), np.frombuffer(experts, np.int32),   # views: no copy
                    np.frombuffer(steps, np.int64))


def records_from_arrays(choices: np.ndarray, moe_layers: Sequence[int]) -> list[TraceRecord]:
    """Build records from ``choices[step, seq, moe_layer_index, k]`` (used by the synthetic generator)."""
    out = []
    steps, nseq = choices.shape[0], choices.shape[1]
    for t in range(steps):
        for s in range(nseq):
            rows = choices[t, s].tolist()
            out.append(TraceRecord(t, s, None, tuple((layer, tuple(rows[li]))
                                                      for li, layer in enumerate(moe_layers))))
    return out
