"""loka.zoo"""

__all__: list[str] = []
