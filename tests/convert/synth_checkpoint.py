"""Synthetic Mixtral-layout safetensors checkpoints: moved to the library (`colibri_format.synthetic`, where
benchmarks/convert.py also takes them); this thin import keeps the tests' old names working."""

from colibri_format.synthetic import mixtral_checkpoint_config as mixtral_config  # noqa: F401
from colibri_format.synthetic import mixtral_tensor_shapes as tensor_shapes  # noqa: F401
from colibri_format.synthetic import write_mixtral_checkpoint as write_checkpoint  # noqa: F401
