"""A checksum of a table file's bytes, stored in the file's own parquet metadata.

Parquet's page checksums are optional and polars neither writes nor verifies them: a flipped
bit in a data page can decode to a different, valid-looking value, and a damaged page or
footer can make the decoder panic or even abort the process on a huge allocation. So the
reader must know the bytes are intact before it hands them to polars.

The writer stores `sha256:` and 64 zeros under the key `loka.checksum`, hashes the whole
file as written, then overwrites the zeros with the digest (same length, so the footer
stays valid). The reader finds the digest in the footer's raw bytes, puts the zeros back,
hashes and compares: any change anywhere in the file, footer included, is caught.
"""

from __future__ import annotations

import hashlib
import re

KEY = "loka.checksum"
PREFIX = "sha256:"
PLACEHOLDER = PREFIX + "0" * 64
_MAGIC = b"PAR1"
# A parquet key-value pair in thrift's compact encoding: field 1 (binary) of length 13 holds
# the key, field 2 (binary) of length 71 the value.
_ENTRY = re.compile(rb"\x18\x0dloka\.checksum\x18\x47sha256:([0-9a-f]{64})")


class DamagedFile(ValueError):
    """The bytes do not hold an intact parquet file with a matching checksum."""


def _footer_start(data: bytes) -> int:
    if len(data) < 12 or data[:4] != _MAGIC or data[-4:] != _MAGIC:
        raise DamagedFile("not a readable parquet file (its start or end marker is missing)")
    length = int.from_bytes(data[-8:-4], "little")
    start = len(data) - 8 - length
    if length <= 0 or start < 4:
        raise DamagedFile("not a readable parquet file (its footer length is impossible)")
    return start


def _find(data: bytes) -> list[re.Match[bytes]]:
    start = _footer_start(data)
    return list(_ENTRY.finditer(data, start, len(data) - 8))


def seal(data: bytes) -> tuple[int, bytes]:
    """Where (offset) and what (the hex digest) to write over the placeholder of a file
    written with `PLACEHOLDER` as the value of `KEY`."""
    found = _find(data)
    if len(found) != 1 or found[0].group(1) != b"0" * 64:
        raise RuntimeError("the written file does not hold exactly one checksum placeholder")
    return found[0].start(1), hashlib.sha256(data).hexdigest().encode()


def verify(data: bytes) -> bool:
    """True if `data` holds a checksum and matches it; False if it holds none (a file from
    before tables carried one). Raises DamagedFile when the bytes were changed."""
    found = _find(data)
    if not found:
        footer = data[_footer_start(data) :]
        if KEY.encode() in footer or PREFIX.encode() in footer:
            raise DamagedFile("damaged table: its checksum entry does not read back")
        return False
    if len(found) > 1:
        raise DamagedFile("damaged table: it holds more than one checksum")
    at = found[0].start(1)
    stored = found[0].group(1)
    zeroed = data[:at] + b"0" * 64 + data[at + 64 :]
    if hashlib.sha256(zeroed).hexdigest().encode() != stored:
        raise DamagedFile("damaged table: its bytes do not match the checksum written with it")
    return True
