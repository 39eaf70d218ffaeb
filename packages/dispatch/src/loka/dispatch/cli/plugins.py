"""Subcommands that other LoKA packages bring to `loka`, found through entry points.

A package adds a subcommand by declaring, in its pyproject.toml,

    [project.entry-points."loka.commands"]
    lora-plan = "loka.plora.cli:add_parser"

where the name is the subcommand and the object is `add_parser(subparsers)`, as for the
built-in commands: it registers the subcommand and sets `func` (called with the parsed
namespace, returns an exit code). Bad input raised as `ValueError` or `OSError` is printed
as one line; so is a `ModuleNotFoundError` (its message names what to install). A package
that is not installed simply has no subcommand; one that fails to load gets a subcommand
that says why, and the other commands keep working.
"""

from __future__ import annotations

import argparse
from importlib.metadata import EntryPoint, entry_points

GROUP = "loka.commands"

# Subcommands of the LoKA packages that install apart from loka-dispatch: asking for one of
# them while its package is absent names the package to install.
KNOWN: dict[str, str] = {"lora-plan": "loka-plora", "reprec": "loka-reprec"}


def command_entry_points() -> list[EntryPoint]:
    """The installed `loka.commands` entry points, one per name, sorted by name."""
    found: dict[str, EntryPoint] = {}
    for point in entry_points(group=GROUP):
        found.setdefault(point.name, point)  # a distribution seen twice on sys.path
    return [found[name] for name in sorted(found)]


def distribution(point: EntryPoint) -> str:
    return point.dist.name if point.dist is not None else point.module


def add_plugin_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register every installed package's subcommand after the built-in ones (which keep
    their names: a package cannot replace them)."""
    for point in command_entry_points():
        if point.name in subparsers.choices:
            continue
        package = distribution(point)
        listed = len(subparsers._choices_actions)  # the help's entries, to undo a half add
        try:
            point.load()(subparsers)
        except Exception as exc:  # a broken package must not take the other commands down
            subparsers.choices.pop(point.name, None)
            del subparsers._choices_actions[listed:]
            _add_unloadable(subparsers, point.name, package, exc)
            continue
        if point.name in subparsers.choices:
            subparsers.choices[point.name].set_defaults(loka_package=package)


def _add_unloadable(
    subparsers: argparse._SubParsersAction, name: str, package: str, exc: Exception
) -> None:
    reason = " ".join(f"{type(exc).__name__}: {exc}".split())
    # No option is known: every argument, `--help` too, is taken as is and the error shown.
    parser = subparsers.add_parser(
        name, help=f"(from {package}, which failed to load)", add_help=False, prefix_chars="\0"
    )
    parser.add_argument("arguments", nargs=argparse.REMAINDER, help="not read")

    def run(args: argparse.Namespace) -> int:
        raise ValueError(f"loka {name} comes with {package}, which failed to load: {reason}")

    parser.set_defaults(func=run, loka_package=package)


def absent_command(argv: list[str], choices: dict) -> str | None:
    """Why the subcommand asked for in `argv` does not exist here, when it is a known LoKA
    package's that is not installed (None otherwise: argparse reports the rest)."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command is None or command in choices or command not in KNOWN:
        return None
    package = KNOWN[command]
    return f"loka {command} comes with {package}, which is not installed: pip install {package}"


def missing_module_message(exc: ModuleNotFoundError, command: str, package: str) -> str:
    """One line for a module a package's subcommand needs and does not find: the package's
    own message where it gave one (naming its extra), else which module is missing."""
    if str(exc) != f"No module named {exc.name!r}":
        return str(exc)
    return f"loka {command} ({package}) needs the Python module {exc.name}, which is not installed"
