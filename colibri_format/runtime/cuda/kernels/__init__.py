"""CUDA kernels of the colibri-format runtime (`*.cu`), their checked CuPy wrappers (`ops`) and NumPy references
(`reference`). Importing this package does not import CuPy."""
