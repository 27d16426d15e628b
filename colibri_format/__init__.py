"""colibri-format: the `.colibri` file format for Mixture-of-Experts models, its tools and engines."""

from .errors import ColibriFormatError
from .reader import ColibriFile, ExpertView, open  # noqa: A004

__version__ = "0.1.0"
__all__ = ["ColibriFormatError", "ColibriFile", "ExpertView", "open", "__version__"]
