"""The `loka` command line.

Each subcommand lives in its own module under `loka.dispatch.cli` and exposes
`add_parser(subparsers)`, which registers the subcommand and sets `func` (called with the
parsed namespace, returns an exit code). Modules are imported lazily so that a command
whose optional dependencies are missing does not break the others. Other LoKA packages
bring their own subcommands through entry points (`loka.dispatch.cli.plugins`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from loka.dispatch.cli.plugins import absent_command, add_plugin_commands, missing_module_message

# Subcommand modules, in the order `loka --help` lists them.
COMMAND_MODULES: tuple[str, ...] = (
    "loka.dispatch.cli.demo",
    "loka.dispatch.cli.probe",
    "loka.dispatch.cli.bench",
    "loka.dispatch.cli.plan",
    "loka.dispatch.cli.report",
)

# The extra that brings everything a command needs, where it is not the missing module's own.
COMMAND_EXTRAS: dict[str, str] = {"demo": "demo", "probe": "demo"}


def version_text() -> str:
    """`loka --version`: this package's version, and those of the LoKA packages installed
    beside it (each installs alone, so versions may differ)."""
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in ("loka-dispatch", "loka-kernels", "loka-mods", "loka-probe", "loka-schema",
                 "loka-stats", "loka-zoo", "loka-plora", "loka-lordba", "loka-reprec"):  # fmt: skip
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            continue
    return "\n".join(found) or "loka: no LoKA package metadata found"


class _Version(argparse.Action):
    """argparse's own version action wraps the text to the terminal: one package a line."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loka",
        description="LoKA: probe FP8 numerics per GEMM site, benchmark kernels, plan and apply.",
    )
    parser.add_argument("--version", action=_Version, help="print the LoKA versions and exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).add_parser(subparsers)
    add_plugin_commands(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    from loka.dispatch.cli._common import device_problem, fail, user_errors
    from loka.dispatch.extras import explain

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    commands = next(a for a in parser._actions if a.dest == "command").choices
    absent = absent_command(argv, commands)
    if absent is not None:  # a LoKA package's subcommand, and that package is not installed
        return fail(absent)
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2

    problem = device_problem(getattr(args, "device", None))
    if problem is not None:  # every command's --device, before any work
        return fail(problem)
    try:
        return int(args.func(args) or 0)
    except user_errors() as exc:  # bad input a command did not report itself: one line
        return fail(str(exc))
    except ImportError as exc:  # an optional package is missing: name the extra
        package = getattr(args, "loka_package", None)
        if package is None:  # dispatch's own command: dispatch's extras
            missing = explain(exc, f"loka {args.command}", extra=COMMAND_EXTRAS.get(args.command))
            if missing is None:
                raise
            return fail(str(missing))
        if not isinstance(exc, ModuleNotFoundError):
            raise
        return fail(missing_module_message(exc, args.command, package))


if __name__ == "__main__":
    raise SystemExit(main())
