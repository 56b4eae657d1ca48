"""`--help` as a user reads it at 80 columns: Rich wraps every text once (the sources hold one
line per paragraph), so no line breaks inside a word and no line ends early in mid-sentence."""

from __future__ import annotations

import re

import pytest
import typer.main
from typer.testing import CliRunner

from attncheck.cli import app

runner = CliRunner()
WIDTH = 80
COMMANDS = [None, "run", "sweep", "check", "capture", "explain", "rope"]


def help_text(command: str | None, width: int = WIDTH) -> str:
    r = runner.invoke(app, [command, "--help"] if command else ["--help"], env={"COLUMNS": str(width)})
    assert r.exit_code == 0, r.output
    return r.stdout


def click_command(command: str | None):
    group = typer.main.get_command(app)
    return group if command is None else group.commands[command]


def source_texts(command: str | None) -> list[str]:
    """The command's help and every parameter's, as written in the source (markup escapes undone)."""
    cmd = click_command(command)
    texts = [cmd.help or ""] + [getattr(p, "help", None) or "" for p in cmd.params]
    return [t.replace("\\[", "[") for t in texts if t]


def description_paragraphs(text: str) -> list[list[str]]:
    """The lines of each paragraph between the usage line and the first panel."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("Usage:")) + 1
    end = next((i for i, line in enumerate(lines) if line.startswith("╭")), len(lines))
    paragraphs, current = [], []
    for line in lines[start:end]:
        if line.strip():
            current.append(line.strip())
        elif current:
            paragraphs.append(current)
            current = []
    return paragraphs + ([current] if current else [])


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_no_help_line_breaks_inside_a_word(command):
    text = help_text(command)
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    shown = set(re.sub(r"[│╭╮╰╯─]", " ", text).split())
    for source in source_texts(command):
        for word in source.split():
            assert word in shown, f"{word!r} of {source[:60]!r}... is broken across lines"


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_help_paragraphs_are_filled_to_the_width(command):
    # Rich indents the description by one column and keeps one free at the right.
    room = WIDTH - 2
    for paragraph in description_paragraphs(help_text(command)):
        for line, following in zip(paragraph, paragraph[1:]):
            assert len(line) + 1 + len(following.split()[0]) > room, f"line ends early:\n{line}\n{following}"


def test_a_sample_sentence_reads_whole():
    sentence = (
        "Var(q.k) grows as d_k; 1/sqrt(d_k) brings it back to 1, 1/d_k to 1/d_k, 1/d_k^2 to 1/d_k^3. Unscaled logits "
        "collapse attention onto one key and kill the softmax gradient; too much scaling flattens it to uniform."
    )
    assert any(sentence in " ".join(p) for p in description_paragraphs(help_text("sweep")))
    wide = help_text("sweep", width=300)
    assert any(line.strip().startswith(sentence) for line in wide.splitlines())
    check = [" ".join(p) for p in description_paragraphs(help_text("check"))]
    assert (
        "Exit codes: 0 every budget holds, 1 a budget broke, 2 configuration or input error (or an internal error, "
        "so that "
        "1 always means a budget)."
    ) in check
