"""Kernel tooling for `ttftc kernels` and `ttftc explain`: the catalog of kernel cases, ahead-of-time compiles for
targets without a device, and the triton-ascend venv. Never imported by a compile: the lowerings live one level up."""
