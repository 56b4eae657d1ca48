"""The file formats attncheck reads, by suffix: each module lists a file's keys, loads
tensors whole, and reads them as row-block sources (see ``common.FileListing``).

Adding a format: a module with ``SUFFIXES`` and ``open_file(path, head, kind, max_bytes) -> FileListing``,
registered in ``FORMATS``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

FORMATS: dict[str, str] = {  # suffix -> module, in the order the help lists them
    ".pt": "attncheck.loaders.formats.pt",
    ".pth": "attncheck.loaders.formats.pt",
    ".npy": "attncheck.loaders.formats.npy",
    ".npz": "attncheck.loaders.formats.npz",
    ".safetensors": "attncheck.loaders.formats.safetensors",
}
SUPPORTED_SUFFIXES = tuple(FORMATS)


def format_for(path: str):
    """The format module for a file's suffix; None for an unsupported one."""
    module = FORMATS.get(Path(path).suffix.lower())
    return None if module is None else importlib.import_module(module)
