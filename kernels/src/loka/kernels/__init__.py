"""loka.kernels"""

__all__: list[str] = []
