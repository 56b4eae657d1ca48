"""The one exception type for bad input, and how it names parameters.

Library code names the parameter a bad value belongs to (``block``, ``dtypes``),
never a command-line flag or a config key: the CLI turns a parameter name into
``--block`` and the config layer into ``tool.attncheck.block``, each in one place
(``AttncheckError.render``).
"""

from __future__ import annotations

import re
from typing import Callable

_MARK = "\x00"  # brackets a parameter name inside a message; never part of user text
_READS_ON = ("must ", "is ", "gives ", "length ")  # messages that read on from the name, without a colon
_PARAM = re.compile(_MARK + r"([A-Za-z_][A-Za-z0-9_.]*)" + _MARK)


def param(name: str) -> str:
    """A parameter named inside an error message, e.g. f"{param('q')} and {param('k')} go together";
    rendered as ``q`` by default, ``--q`` by the CLI."""
    return f"{_MARK}{name}{_MARK}"


class AttncheckError(Exception):
    """Bad input or usage: a missing or corrupt file, an unsupported dtype, a bad option.

    The message is a single line meant for the user; the CLI prints it on stderr
    and exits with code 2. ``param``, when given, is the parameter the message is
    about; the message is then shown as ``<name>: <message>``.
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def render(self, name_of: Callable[[str], str] = lambda name: name) -> str:
        """The message with every parameter shown as ``name_of(parameter)``: 'block must be
        an integer >= 1, got 0', 'dtypes: unknown dtype 'fp8' (...)'."""
        text = _PARAM.sub(lambda m: name_of(m.group(1)), self.message)
        if not self.param:
            return text
        sep = " " if text.startswith(_READS_ON) else ": "
        return f"{name_of(self.param)}{sep}{text}"

    def __str__(self) -> str:
        return self.render()
