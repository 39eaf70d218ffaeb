"""Subcommands of other packages through `loka.commands` entry points: found, run, isolated
when broken, refused one line at a time when their package is absent."""

from __future__ import annotations

import textwrap
from importlib.metadata import EntryPoint

import pytest

from loka.dispatch.cli import build_parser, main, plugins

PLUGIN = textwrap.dedent(
    """
    def add_parser(subparsers):
        parser = subparsers.add_parser("hello", help="say hello")
        parser.add_argument("--name", default="world", help="whom to greet")
        parser.add_argument("--fail", default=None, help="raise this kind of error")
        parser.set_defaults(func=run)


    def run(args):
        if args.fail == "value":
            raise ValueError(f"bad name {args.name!r}")
        if args.fail == "own-hint":
            raise ModuleNotFoundError("hello needs PyYAML: pip install 'hello[yaml]'", name="yaml")
        if args.fail == "bare":
            import no_such_module_anywhere  # noqa: F401
        print(f"hello {args.name} from {args.loka_package}")
        return 0


    def add_demo(subparsers):
        subparsers.add_parser("demo", help="not the real demo")


    def add_broken(subparsers):
        raise RuntimeError("this plugin is broken")
    """
)


@pytest.fixture
def fake_plugins(tmp_path, monkeypatch):
    """Install the entry points `names` (name -> object in the module above) and nothing else."""
    (tmp_path / "loka_fake_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))

    def install(**names: str) -> None:
        points = [
            EntryPoint(name, f"loka_fake_plugin:{obj}", plugins.GROUP)
            for name, obj in names.items()
        ]
        monkeypatch.setattr(plugins, "entry_points", lambda group: points)

    return install


def _lines(capsys) -> list[str]:
    captured = capsys.readouterr()
    return [line for line in (captured.out + captured.err).splitlines() if line.strip()]


def test_an_installed_packages_subcommand_is_found_and_runs(fake_plugins, capsys):
    fake_plugins(hello="add_parser")
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert list(commands)[-1] == "hello"  # after the built-in commands
    assert main(["hello", "--name", "you"]) == 0
    assert _lines(capsys) == ["hello you from loka_fake_plugin"]


@pytest.mark.parametrize(
    ("fail", "line"),
    [
        ("value", "error: bad name 'x'"),
        ("own-hint", "error: hello needs PyYAML: pip install 'hello[yaml]'"),
        ("bare", "error: loka hello (loka_fake_plugin) needs the Python module "
                 "no_such_module_anywhere, which is not installed"),
    ],
)  # fmt: skip
def test_a_subcommands_bad_input_and_missing_modules_are_one_line(fake_plugins, capsys, fail, line):
    fake_plugins(hello="add_parser")
    assert main(["hello", "--name", "x", "--fail", fail]) == 1
    assert _lines(capsys) == [line]


def test_a_package_cannot_replace_a_built_in_command(fake_plugins):
    fake_plugins(demo="add_demo")
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert commands["demo"].get_default("loka_package") is None
    assert "--warmup-steps" in commands["demo"].format_help()  # dispatch's own demo


def test_a_broken_package_leaves_the_others_working(fake_plugins, capsys):
    fake_plugins(broken="add_broken", hello="add_parser")
    assert main(["hello"]) == 0
    capsys.readouterr()
    assert main(["broken", "--anything", "at all"]) == 1
    (line,) = _lines(capsys)
    assert line.startswith("error: loka broken comes with loka_fake_plugin, which failed to load")
    assert "RuntimeError: this plugin is broken" in line


def test_a_known_command_of_an_absent_package_names_the_package(fake_plugins, monkeypatch, capsys):
    monkeypatch.setitem(plugins.KNOWN, "hello", "loka-hello")
    fake_plugins()  # no package brings a subcommand
    assert main(["hello", "--help"]) == 1
    assert _lines(capsys) == [
        "error: loka hello comes with loka-hello, which is not installed: pip install loka-hello"
    ]
    fake_plugins(hello="add_parser")  # installed: it runs
    assert main(["hello"]) == 0


def test_an_unknown_command_is_still_argparses_usage_error(fake_plugins, capsys):
    fake_plugins()
    with pytest.raises(SystemExit) as info:
        main(["no-such-command"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
