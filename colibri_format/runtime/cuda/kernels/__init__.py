"""CUDA kernels of the colibri-format runtime (`*.cu`) and their checked CuPy wrappers (`ops`). Their oracle is
`runtime.numpy_backend` on float64 inputs. Importing this package does not import CuPy."""
