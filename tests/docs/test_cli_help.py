"""``pid-plugins --help`` and every subcommand's, and the same of ``python -m research`` (the demo, reproduce and
study beside the package): plain text, a description, help and a default for every option."""
import argparse
import re

import pytest

import pid_plugins
import research.cli
from pid_plugins import cli

MARKUP = re.compile(r"``|:(func|class|mod|meth|data|attr):`|::|\.\. \w+::|\*\*")


CLIS = {"pid-plugins": cli, "research": research.cli}


def _commands(module):
    parser = module.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return parser, sub.choices


def _help(module, argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        module.main(argv)
    assert exit_.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name, command", [(name, command) for name, module in CLIS.items()
                                           for command in (None, *sorted(_commands(module)[1]))])
def test_every_help_is_plain_text_with_a_description_and_help_for_every_option(name, command, capsys):
    parser, commands = _commands(CLIS[name])
    text = _help(CLIS[name], ["--help"] if command is None else [command, "--help"], capsys)
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
    assert _help(cli, ["--version"], capsys).strip() == f"pid-plugins {pid_plugins.__version__}"
