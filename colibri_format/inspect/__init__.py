"""`colibri inspect` (header and tables only) and `colibri validate` (every byte), as library calls."""

from .inspect import inspect_file
from .validate import Fault, ValidationReport, validate_file

__all__ = ["inspect_file", "validate_file", "ValidationReport", "Fault"]
