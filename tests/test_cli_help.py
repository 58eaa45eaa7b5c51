"""``pid-plugins --help`` and every subcommand's: plain text, a description, help and a default for every option."""
import argparse
import re

import pytest

import pid_plugins
from pid_plugins.research.cli import build_parser, main

MARKUP = re.compile(r"``|:(func|class|mod|meth|data|attr):`|::|\.\. \w+::|\*\*")


def _commands():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return parser, sub.choices


def _help(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", [None, *sorted(_commands()[1])])
def test_every_help_is_plain_text_with_a_description_and_help_for_every_option(command, capsys):
    parser, commands = _commands()
    text = _help(["--help"] if command is None else [command, "--help"], capsys)
    options = text.split("\noptions:\n", 1)[1]
    assert not MARKUP.search(text), MARKUP.search(text)
    target = parser if command is None else commands[command]
    assert target.description and target.description.strip()[0].isupper()
    assert " ".join(target.description.split())[:40] in " ".join(text.split())
    for action in target._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        assert action.help and action.help.strip(), f"{command}: {action.option_strings or action.dest} has no help"
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS) and action.required is False:
            entry = re.search(rf"^  {re.escape(action.option_strings[0])}\b.*?(?=^  -|\Z)", options, re.M | re.S)
            assert entry and "(default:" in entry.group(0), (command, action.option_strings)
    if command is None:  # the overview names every command with its summary
        for name, sub in commands.items():
            assert re.search(rf"^\s+{name}\b", text, re.M), name


def test_version(capsys):
    assert _help(["--version"], capsys).strip() == f"pid-plugins {pid_plugins.__version__}"
