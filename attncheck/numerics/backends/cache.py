"""Where the numba kernels' compiled code is kept: one decision per process, imported by the kernels module
(which points numba's cache at it) and by ``numba_rows`` (which stamps what it compiled)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_cache_dir: Path | None | bool = False  # False: not decided yet; None: no writable directory


def _writable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()  # what numba itself tries
        return True
    except OSError:
        return False


def cache_dir() -> Path | None:
    """Where compiled kernels are kept: the first writable of $NUMBA_CACHE_DIR, the user's
    cache directory, a folder in the temporary directory; None when none is writable."""
    global _cache_dir
    if _cache_dir is False:
        user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attncheck" / "numba"
        temp = Path(tempfile.gettempdir()) / f"attncheck-numba-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
        given = os.environ.get("NUMBA_CACHE_DIR")
        candidates = [Path(given)] if given else [user, temp]
        _cache_dir = next((c for c in candidates if _writable(c)), None)
    return _cache_dir
