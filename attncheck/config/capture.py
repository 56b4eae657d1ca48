"""What ``attncheck capture`` is asked to do: the script, where the capture goes, its bounds
(torch-free, checked before the script runs)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from attncheck import params
from attncheck.config.run import Options, ignore_codes
from attncheck.errors import AttncheckError

DEFAULT_OUT = "attncheck-capture"
DEFAULT_MAX_BYTES = "1GiB"
DEFAULT_MAX_CALLS = 1000


@dataclass(frozen=True)
class CaptureRequest:
    """Run ``script`` with ``args`` under capture, then diagnose what it recorded as ``run`` does
    (``options``, ``ignore``, ``partial``). ``out`` None: diagnose each call as it comes and
    write nothing."""

    script: str
    args: tuple[str, ...] = ()
    out: str | None = DEFAULT_OUT
    max_calls: int | None = DEFAULT_MAX_CALLS
    max_bytes: int | None = None
    modules: tuple[str, ...] = ()
    forwards: str | None = None  # '1', '1,3', '2-4'; None: all
    options: Options = Options()
    ignore: tuple[str, ...] = ()
    partial: bool = False
    what_if: tuple[str, ...] = ()  # as RunRequest's
    grid_asked: bool = False
    grads: bool = True  # record dO and the kernels' gradients when the script runs a backward
    compile: str = (
        "eager"  # torch.compile'd code: run as its eager code and recorded, or kept compiled and not recorded
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "ignore", ignore_codes(self.ignore))
        object.__setattr__(self, "what_if", params.what_if(list(self.what_if)) if self.what_if else ())
        try:
            os.stat(self.script)
        except OSError as e:
            why = "no such file" if isinstance(e, FileNotFoundError) else (e.strerror or str(e))
            raise AttncheckError(f"{self.script}: {why} (give the Python script to run)", param="script") from None
        if not os.path.isfile(self.script):
            what = "is a folder" if os.path.isdir(self.script) else "is not a file"
            raise AttncheckError(f"{self.script}: {what} (give the Python script to run)", param="script")
        if self.out is not None:
            parent = os.path.dirname(os.path.abspath(self.out))
            if not os.path.isdir(parent):
                raise AttncheckError(f"cannot create {self.out}: folder {parent} does not exist", param="out")
            try:
                os.stat(self.out)
            except FileNotFoundError:
                pass
            except OSError as e:  # a name longer than the file system allows
                raise AttncheckError(f"cannot create {self.out}: {e.strerror or e}", param="out") from None
            if os.path.exists(self.out) and not os.path.isdir(self.out):
                raise AttncheckError(f"{self.out} is a file; give a folder for the capture", param="out")
        if self.max_calls is not None:
            params.integer(self.max_calls, "max_calls", 1, from_text=False)
        if self.max_bytes is None:
            object.__setattr__(self, "max_bytes", params.size(DEFAULT_MAX_BYTES, "max_bytes"))
