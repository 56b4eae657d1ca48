"""attncheck: numerical diagnostics for the softmax inside attention.

Importing the package is cheap: torch and numpy are imported only by the
modules that compute (``precision``, ``softmax``, ``diagnose``, ``loaders``).
"""

__version__ = "0.1.0"

from attncheck.errors import AttncheckError

__all__ = ["AttncheckError", "__version__"]
