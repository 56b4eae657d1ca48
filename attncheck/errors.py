"""The one exception type for bad input."""


class AttncheckError(Exception):
    """Bad input or usage: a missing or corrupt file, an unsupported dtype, a bad option.

    The message is a single line meant for the user; the CLI prints it on stderr
    and exits with code 2.
    """
