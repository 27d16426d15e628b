"""The CUDA wing of the runtime: backend (the one door to CuPy), kernels, dense weights, expert pager, step runner and graphs, kernel limits and the benchmark library."""
