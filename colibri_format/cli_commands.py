"""Commands backed by the converter and the engines (imported lazily by `colibri_format.cli`)."""
