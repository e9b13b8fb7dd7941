"""C sources compiled at run time by ``tokenmill.model.kernels.cpu_kernels`` (data, not Python)."""
