"""`python -m loka.stats [FILE.npy]`: summarize an array and its FP8 range fit.

Without a file, summarizes the bundled example (activations with outlier channels).
A 2-D array is read as [rows, cols]; more dimensions are flattened to rows of the last one;
1-D arrays give tensorwise statistics only. float32 and float16 are read as they are,
float64 is rounded to float32, and uint16/int16 are bfloat16 bit patterns with --bf16.
"""

import argparse
import sys
from importlib.resources import files
from pathlib import Path

import numpy as np

from loka.stats import Sketch
from loka.stats._report import report

EXAMPLE = "example_activations.npy"


def load(path: Path | None) -> tuple[str, np.ndarray]:
    if path is None:
        with files("loka.stats").joinpath("data", EXAMPLE).open("rb") as f:
            return f"bundled example ({EXAMPLE})", np.load(f)
    return str(path), np.load(path, allow_pickle=False)


def sketch_of(x: np.ndarray, block: int, bf16: bool) -> Sketch:
    if bf16 and x.dtype not in (np.uint16, np.int16):
        raise SystemExit(f"--bf16 expects uint16/int16 bit patterns, the file holds {x.dtype}")
    if not bf16:
        if x.dtype == np.float64:
            x = x.astype(np.float32)
        elif x.dtype not in (np.float32, np.float16):
            raise SystemExit(
                f"cannot summarize dtype {x.dtype}: expected float32, float16 or float64 "
                "(bfloat16 as uint16/int16 bit patterns with --bf16)"
            )
    sketch = Sketch()
    if x.ndim >= 2 and x.size:
        sketch.update_rows(np.ascontiguousarray(x.reshape(-1, x.shape[-1])), block, bf16=bf16)
    else:
        sketch.update(np.ascontiguousarray(x), bf16=bf16)
    return sketch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loka.stats", description=__doc__)
    parser.add_argument("file", nargs="?", type=Path, help=".npy file (default: the example)")
    parser.add_argument("--block", type=int, default=128, help="tile width (default 128)")
    parser.add_argument("--bf16", action="store_true", help="uint16/int16 hold bfloat16 bits")
    args = parser.parse_args(argv)
    if args.block < 1:
        parser.error("--block must be at least 1")
    try:
        name, x = load(args.file)
    except (OSError, ValueError) as e:
        parser.error(f"cannot read {args.file}: {e}")
    sketch = sketch_of(x, args.block, args.bf16)
    shape = "x".join(map(str, x.shape)) or "scalar"
    kind = "bfloat16" if args.bf16 else str(x.dtype)
    try:
        print(report(f"loka.stats: {name}, {kind} [{shape}], {x.size} values", sketch))
    except BrokenPipeError:  # e.g. piped into `head`
        sys.stderr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
