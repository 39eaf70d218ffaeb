"""`loka --version`, help for every option, and a bad model name refused before any work."""

from __future__ import annotations

import pytest

from loka.dispatch.cli import build_parser, main


def test_version_names_every_installed_loka_package(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("loka-dispatch ") and "loka-kernels" in " ".join(lines)


def test_every_option_of_every_command_has_help() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    missing = [
        f"loka {name} {'/'.join(action.option_strings)}"
        for name, sub in commands.items()
        for action in sub._actions
        if action.option_strings and action.dest != "help" and not action.help
    ]
    for name in ("demo", "probe", "bench", "plan", "report"):  # the options issue 18 named
        options = {s for a in commands[name]._actions if a.help for s in a.option_strings}
        assert {"--out", "--device", "--seed"} & {
            s for a in commands[name]._actions for s in a.option_strings
        } <= options
    assert not [m for m in missing if m.split()[-1] in ("--out", "--device", "--seed")], missing


def test_probe_refuses_an_unknown_model_before_drawing_progress(capsys) -> None:
    assert main(["probe", "nosuchmodel", "--steps", "1"]) == 1
    out = capsys.readouterr()
    text = out.out + out.err
    assert "no zoo model 'nosuchmodel'" in text and "dhen" in text
    assert "probing" not in text  # the progress bar's label


def test_probe_help_names_every_zoo_model_and_preset() -> None:
    # The help names them as text (loading the zoo would load torch for `loka --help`).
    zoo = pytest.importorskip("loka.zoo")
    from loka.zoo.registry import PRESETS

    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    helps = {a.dest: a.help for a in commands["probe"]._actions}
    assert all(name in helps["model"] for name in zoo.MODELS), helps["model"]
    assert all(preset in helps["preset"] for preset in PRESETS), helps["preset"]
