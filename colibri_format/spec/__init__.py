"""The `.colibri` v1 format: the single source of truth for every byte (normative text: docs/spec.md)."""

from .constants import *  # noqa: F401,F403  (named constants and enums are the public spec)
from .constants import DType, ExpertFormat, Section
from .layout import BlobArray, BlobLayout, FilePlan, PlannedTensor, align_up, blob_layout, plan_file
from .metadata import check_metadata, check_model, decode_metadata, encode_metadata
from .structs import (DENSE_ENTRY_FIELDS, HEADER_FIELDS, WSIT_ENTRY_FIELDS, DenseEntry, Field, Header,
                      WsitEntry)
from .tensors import canonical_dense_tensors

__all__ = [
    "DType", "ExpertFormat", "Section", "BlobArray", "BlobLayout", "FilePlan", "PlannedTensor", "align_up",
    "blob_layout", "plan_file", "check_metadata", "check_model", "decode_metadata", "encode_metadata",
    "DENSE_ENTRY_FIELDS", "HEADER_FIELDS", "WSIT_ENTRY_FIELDS", "DenseEntry", "Field", "Header", "WsitEntry",
    "canonical_dense_tensors",
]
