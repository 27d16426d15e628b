"""The one error family of colibri-format.

Every fault found in a file, a checkpoint or a user's input is raised as a subclass of
:class:`ColibriFormatError`, naming the field, the offending value and (for files) the byte offset.
The CLI maps this family to one clear line and an exit code; nothing else should escape.
"""

from __future__ import annotations


class ColibriFormatError(ValueError):
    """Base class: a fault in a `.colibri` file, a source checkpoint or a user input."""

    def __init__(self, message: str, *, field: str | None = None, value: object = None,
                 offset: int | None = None) -> None:
        self.field = field
        self.value = value
        self.offset = offset
        super().__init__(self._render(message))

    def _render(self, message: str) -> str:
        parts = [message]
        details = []
        if self.field is not None:
            details.append(f"field={self.field}")
        if self.value is not None:
            details.append(f"value={_short(self.value)}")
        if self.offset is not None:
            details.append(f"offset={self.offset}")
        if details:
            parts.append("(" + ", ".join(details) + ")")
        return " ".join(parts)


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- reading a file -------------------------------------------------------------------------------
class NotARegularFile(ColibriFormatError):
    """The path is a directory, FIFO, device or otherwise not a regular file."""


class TruncatedFile(ColibriFormatError):
    """The file is shorter than its header or its declared size."""


class BadMagic(ColibriFormatError):
    """The first bytes are not the `.colibri` magic."""


class UnsupportedVersion(ColibriFormatError):
    """Major version this reader does not implement (or a byte-swapped version)."""


class CorruptHeader(ColibriFormatError):
    """Header checksum mismatch or a reserved header byte that is not zero."""


class InvalidHeaderField(ColibriFormatError):
    """A header field is out of range, over a limit, or inconsistent with another."""


class LayoutError(ColibriFormatError):
    """Sections, tensors or blobs overlap, leave a gap, are misaligned or leave the file."""


class SizeMismatch(ColibriFormatError):
    """Declared file size differs from the real size, or a tensor size from its shape."""


class CorruptSection(ColibriFormatError):
    """A section (metadata, dense directory, WSIT) fails its checksum."""


class InvalidDirectoryEntry(ColibriFormatError):
    """A dense-directory or WSIT entry is malformed (name, dtype, shape, ids)."""


class InvalidMetadata(ColibriFormatError):
    """Metadata is not valid UTF-8 JSON, breaks the schema or disagrees with the header."""


class CorruptTensor(ColibriFormatError):
    """A dense tensor fails its checksum."""


class CorruptExpert(ColibriFormatError):
    """An expert blob fails its checksum; never pass its data to a kernel."""


class NonZeroPadding(ColibriFormatError):
    """A byte that the spec says MUST be zero is not."""


# --- converting -----------------------------------------------------------------------------------
class InvalidInput(ColibriFormatError):
    """A user argument or a source checkpoint is malformed."""


class UnsupportedModel(ColibriFormatError):
    """The checkpoint's architecture or one of its features is not supported."""


class ResumeError(ColibriFormatError):
    """A partial conversion cannot be resumed (input changed, journal damaged)."""


class WriteError(ColibriFormatError):
    """Writing the output failed (disk full, file size limit, I/O error)."""


class OutputPathRefused(InvalidInput):
    """An output path (convert's `--output-path`, infer's `--trace`) holds something the tool must not replace: a
    file it did not write, the model or one of the checkpoint's own files, a link, a FIFO or device, or (without
    --force) an existing file."""


class UnusedTensors(InvalidInput):
    """The checkpoint holds tensors the conversion would drop (e.g. a config with fewer layers)."""


class NonFiniteWeight(InvalidInput):
    """A weight is NaN or infinite, or does not fit the dtype it is stored in (float16 or float32 overflow)."""


class InvalidTokenizer(InvalidInput):
    """A tokenizer file does not load, or a special token, token id or chat template has the wrong type."""


# --- running a model (runtime engines) ------------------------------------------------------------
class EmptyInput(InvalidInput):
    """An inference request has no sequences, or a sequence has no token ids."""


class TokenIdOutOfRange(InvalidInput):
    """A token id is not an integer in [0, vocab_size)."""


class SequenceTooLong(InvalidInput):
    """A sequence is longer than the engine's `max_seq_len`."""


class BatchTooLarge(InvalidInput):
    """A request holds more sequences than the engine's `max_batch_size`."""
