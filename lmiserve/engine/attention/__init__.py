"""Attention over the paged KV cache: the pool and its reads and writes (`paged`), the sliding windows
(`windows`), the kernels (`cpu_kernel`: numba on CPU; `triton_ops`: Triton on CUDA), the backends that
the model forwards run (`backends`) and the CUDA graphs that replay decode steps (`cuda_graphs`)."""
