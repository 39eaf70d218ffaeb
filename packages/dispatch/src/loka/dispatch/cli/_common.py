"""Helpers shared by the `loka` commands of loka-dispatch (demo, probe, bench, plan, report)."""

from __future__ import annotations

import os
import sys


def use_interpreter_without_gpu() -> None:
    """Without a CUDA GPU, run Triton kernels in its CPU interpreter. Must happen before
    loka.kernels is first imported (Triton decides when a kernel is defined). Most FP8 sites
    never reach it (`apply` emulates tensor/row dynamic recipes on `torch.native.cpu`); it
    is still what runs block-scaled and delayed-scaling sites on the CPU."""
    if "loka.kernels" in sys.modules:
        return
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def device_problem(device: str | None) -> str | None:
    """Why `--device` cannot be used on this machine (None when it can)."""
    if device is None:
        return None
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        return f"--device {device!r} is not a torch device (e.g. cpu, cuda, cuda:1)"
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            return f"--device {device}: no CUDA GPU is available here (use --device cpu)"
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            return f"--device {device}: this machine has {torch.cuda.device_count()} GPU(s)"
    elif parsed.type != "cpu":
        return f"--device {device}: loka runs on cpu or cuda"
    return None


def fail(message: str) -> int:
    """Print an error the way every loka command does and return exit status 1.

    The message is printed as text, never read as rich markup (a recipe's `[/pow2]` or a
    path's `[red]` are the user's words), and on one line: rich does not wrap it."""
    from rich.markup import escape

    from loka.dispatch.console import console

    text = " ".join(str(message).split()) or "failed"
    console.print(f"[bold red]error:[/] {escape(text)}", soft_wrap=True)
    return 1


def user_errors() -> tuple[type[Exception], ...]:
    """The errors a command reports as a message (bad input), not as a traceback."""
    from loka.dispatch.bench import CacheMismatchError
    from loka.schema import SchemaError

    return (OSError, SchemaError, CacheMismatchError, ValueError)
