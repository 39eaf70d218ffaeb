"""loka.mods"""

__all__: list[str] = []
