"""attncheck: numerical diagnostics for the softmax inside attention.

Importing the package is cheap: torch and numpy come in only with the names that
compute, on first use::

    from attncheck import Options, diagnose

    result = diagnose("layer0.scores", scores, Options(dtypes=("fp16",)))

Layers: ``loaders`` (files -> tensors), ``numerics`` (tensors -> numbers),
``judge`` (numbers -> findings: ``diagnose`` here is the judged one), ``report``
(results -> tables, JSON), ``cli`` (commands), ``pipelines`` (each command as a
library call); ``registry`` holds the methods and dtypes, ``results`` the result
types, ``findings`` what they mean.
"""

__version__ = "0.1.0"

import importlib

from attncheck.errors import AttncheckError

# name -> module it lives in, imported on first access (PEP 562)
_LAZY = {
    "Options": "attncheck.config.run",
    "diagnose": "attncheck.judge",
    "diagnose_chunks": "attncheck.judge",
    "diagnose_attention": "attncheck.judge",
    "capture": "attncheck.record",
    "watch": "attncheck.watcher",
    "load_tensors": "attncheck.loaders",
    "open_sources": "attncheck.loaders",
    "METHODS": "attncheck.registry",
    "DTYPES": "attncheck.registry",
    "MethodSpec": "attncheck.registry",
    "DtypeSpec": "attncheck.registry",
}

__all__ = ["AttncheckError", "__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'attncheck' has no attribute {name!r}")
