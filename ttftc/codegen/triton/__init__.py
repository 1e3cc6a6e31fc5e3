"""Triton kernels: CUDA GPUs, Ascend through triton-ascend, and CPU tensors under TRITON_INTERPRET=1 (tests)."""
