"""C sources compiled at run time by ``tokenmill.model.cpu_kernels`` (data, not Python)."""
