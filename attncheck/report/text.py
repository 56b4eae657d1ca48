"""Untrusted text in Rich output: names from files (tensors, members, keys, modules, paths) and the
messages that quote them are printed as themselves, never read as markup or acted on by the terminal."""

from __future__ import annotations

from rich.text import Text

from attncheck.format import visible


def shown(text: object, style: str = "") -> Text:
    """``text`` as a Rich ``Text``: markup stays literal ('[/]' prints as '[/]') and control
    characters are written as escapes (``format.visible``)."""
    return Text(visible(text), style=style)
