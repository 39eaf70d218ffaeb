"""loka.dispatch"""

__all__: list[str] = []
