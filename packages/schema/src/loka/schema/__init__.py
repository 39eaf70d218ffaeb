"""loka.schema"""

__all__: list[str] = []
