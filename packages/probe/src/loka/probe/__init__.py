"""loka.probe"""

__all__: list[str] = []
