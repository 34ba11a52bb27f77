"""The `kvpool` command explains itself: a help line per subcommand, flags in named groups."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from kvpool.apps import cli

MOST_UNGROUPED = 2
"""Flags a subcommand may leave in argparse's default "options" group besides --help
(e.g. --log-level); everything else belongs to a named group."""


def _default_group(ap: argparse.ArgumentParser) -> list[str]:
    # argparse keeps the default group as _optionals; its title is "options" (3.10+).
    return [a.option_strings[-1] for a in ap._optionals._group_actions
            if not isinstance(a, argparse._HelpAction)]


def test_kvpool_help_lists_every_subcommand_with_its_line() -> None:
    # Wide columns: argparse would otherwise break "end-to-end" at its hyphen.
    out = subprocess.run([sys.executable, "-m", "kvpool", "--help"], capture_output=True, text=True,
                         timeout=60, check=True, env={**os.environ, "COLUMNS": "400"}).stdout
    assert len(cli.SUBCOMMANDS) == 7
    flat = " ".join(out.split())
    for name, cmd in cli.SUBCOMMANDS.items():
        assert len(cmd.help.split()) >= 4, f"{name}: a help line says what the command does"
        assert f"{name} {cmd.help}" in flat, f"{name} has no help line in `kvpool --help`"


@pytest.mark.parametrize("name", list(cli.SUBCOMMANDS))
def test_subcommand_flags_are_in_named_groups(name: str) -> None:
    ap = cli.subcommand_parser(name)
    loose = _default_group(ap)
    assert len(loose) <= MOST_UNGROUPED, f"kvpool {name}: flags outside any group: {loose}"
    named = [g for g in ap._action_groups if g is not ap._optionals and g is not ap._positionals]
    assert named, f"kvpool {name} has no flag groups"
    for group in named:
        assert group.title and group._group_actions, f"kvpool {name}: empty or untitled group {group.title!r}"
    undocumented = [a.option_strings[-1] for a in ap._actions
                    if a.option_strings and not a.help and a.help != argparse.SUPPRESS]
    assert not undocumented, f"kvpool {name}: flags without a help text: {undocumented}"


def test_subcommand_help_is_its_own_parser() -> None:
    """`kvpool store --help` reaches the store's parser (the groups show), not the top level's."""
    out = subprocess.run([sys.executable, "-m", "kvpool", "store", "--help"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert "usage: kvpool store" in out
    assert "security:" in out and "capacity (tiers):" in out
