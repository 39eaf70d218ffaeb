"""`python -m loka.schema [TABLE]`: print the table contract."""

import sys

from loka.schema.tables import SCHEMA_VERSION, TABLES, table


def main(argv: list[str]) -> int:
    names = argv or list(TABLES)
    print(f"LoKA tables, schema version {SCHEMA_VERSION}")
    for name in names:
        tbl = table(name)
        print(f"\n{tbl.name}: {tbl.doc}\n  key: {', '.join(tbl.key)}")
        for col in tbl.columns:
            null = "" if not col.nullable else " (nullable)"
            if col.optional:
                null += f" (since version {col.since}; missing: {col.default})"
            values = (
                f" [{col.range.describe(col.dtype.is_integer())}]" if col.range is not None else ""
            )
            print(f"  {col.name:24s} {col.dtype!s:12s} {col.doc}{null}{values}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
