"""The one exception family for every fault in a file or a user input.

Minimal version created by the converter work; the spec owner extends it.
Every error carries an optional machine-readable location: the `field` it is
about, the offending `value`, and a byte `offset` when it comes from a file.
"""

from __future__ import annotations


class ColibriFormatError(ValueError):
    """Base class: a bad file, a bad checkpoint or a bad user input."""

    def __init__(self, message: str, *, field: str | None = None, value: object = None,
                 offset: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.value = value
        self.offset = offset


class InvalidInput(ColibriFormatError):
    """An input is malformed, out of range, or of the wrong type."""


class UnsupportedModel(ColibriFormatError):
    """A well-formed input that this version does not handle (architecture, feature)."""
