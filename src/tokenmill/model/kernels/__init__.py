"""The C kernels (csrc/) and their Python bindings and build."""
