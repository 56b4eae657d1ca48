"""Where recorded calls go: a capture directory, memory, or a diagnosis on the fly.

A capture directory holds one ``.safetensors`` per call (``NNNN-<module>.safetensors``, its
metadata in the header) and ``manifest.json``. Writing never leaves the directory: file
names are made from the call index and a sanitised module path, and an existing directory
is reused only when it is empty or holds a previous capture (whose own files are replaced).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

import torch

from attncheck import __version__
from attncheck.errors import AttncheckError
from attncheck.loaders.calls import CALL_FILE, CAPTURE_SCHEMA, MANIFEST, call_file_name, info_from_meta
from attncheck.record.mode import Recorded
from attncheck.results import CallReport


def cpu_tensors(tensors: dict[str, torch.Tensor], copy: bool) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, none sharing storage with another (safetensors refuses that);
    ``copy``: always a copy of the data, so later in-place changes of the model's tensors
    cannot reach it."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for role, t in tensors.items():
        t = t.detach()
        moved = t.device.type != "cpu"
        if moved:
            t = t.to("cpu")
        if not t.is_contiguous():
            t = t.contiguous()
            moved = True
        ptr = t.untyped_storage().data_ptr()
        if (copy and not moved) or ptr in seen:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        out[role] = t
    return out


def prepare_directory(path: str | os.PathLike[str]) -> Path:
    """The capture directory, created (its parent must exist) or emptied of a previous capture."""
    d = Path(path)
    if d.exists() and not d.is_dir():
        raise AttncheckError(f"capture directory {d} is a file", param="path")
    if not d.exists():
        if not d.parent.is_dir():
            raise AttncheckError(f"cannot create capture directory {d}: folder {d.parent} does not exist", param="path")
        try:
            d.mkdir()
        except OSError as e:
            raise AttncheckError(f"cannot create capture directory {d}: {e.strerror or e}", param="path") from None
        return d
    entries = list(d.iterdir())
    if not entries:
        return d
    manifest = d / MANIFEST
    if not manifest.is_file():
        raise AttncheckError(f"capture directory {d} is not empty and holds no capture ({MANIFEST}); give a new or empty folder", param="path")
    try:
        doc = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        doc = None
    if not isinstance(doc, dict) or not str(doc.get("schema", "")).startswith("attncheck.capture/"):
        raise AttncheckError(f"capture directory {d} is not empty and its {MANIFEST} is not a capture's; give a new or empty folder", param="path")
    for p in entries:  # a previous capture: its own files go, anything else stays
        if p.is_file() and (p.name == MANIFEST or CALL_FILE.match(p.name)):
            p.unlink()
    return d


class DirectorySink:
    """Writes each call as it comes (the tensors are not kept), and the manifest at the end."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.dir = prepare_directory(path)
        self.entries: list[dict] = []
        self.bytes = 0

    def __call__(self, call: Recorded) -> None:
        from safetensors.torch import save_file

        name = call_file_name(call.index, call.module)
        tensors = cpu_tensors(call.tensors, copy=False)  # written now: no copy is needed to freeze them
        try:
            save_file(tensors, str(self.dir / name), metadata=call.meta)
        except OSError as e:
            raise AttncheckError(f"cannot write {self.dir / name}: {e.strerror or e}") from None
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        self.bytes += size
        self.entries.append({
            "index": call.index, "file": name, "kind": call.kind, "module": call.module, "forward": call.forward,
            "bytes": size, "tensors": {role: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for role, t in tensors.items()},
        })

    def close(self, facts: dict) -> None:
        doc = {"schema": CAPTURE_SCHEMA, "attncheck_version": __version__, "torch_version": torch.__version__,
               "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **facts, "total_bytes": self.bytes, "calls": self.entries}
        tmp = self.dir / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, self.dir / MANIFEST)


class MemorySink:
    """Keeps every call, its tensors copied to the CPU as they are recorded."""

    def __init__(self) -> None:
        self.calls: list[Recorded] = []

    def __call__(self, call: Recorded) -> None:
        self.calls.append(Recorded(call.index, call.kind, call.module, call.forward, cpu_tensors(call.tensors, copy=True), dict(call.meta)))

    def close(self, facts: dict) -> None:
        pass


class DiagnoseSink:
    """Diagnoses each call as it comes and keeps only the result."""

    def __init__(self, options, ignore=(), notice: Callable[[str], None] | None = None) -> None:
        from dataclasses import replace

        from attncheck.numerics.diagnose import resolve_device

        self.options = replace(options, device=str(resolve_device(options.device)))
        self.ignore, self.notice = tuple(ignore), notice
        self.reports = []

    def __call__(self, call: Recorded) -> None:
        from attncheck.findings import apply_ignore
        from attncheck.numerics.calls import diagnose_call

        info = info_from_meta(call.meta, index=call.index, name=f"{call.index:04d}-{call.module or 'global'}", file=None)
        tensors = cpu_tensors(call.tensors, copy=False)
        device_type = next(iter(call.tensors.values())).device.type
        try:
            with torch.no_grad(), torch.autocast(device_type=device_type, enabled=False):  # the diagnosis computes in the dtypes it names
                report = diagnose_call(info, tensors, self.options, notice=self.notice)
        except AttncheckError as e:  # the model runs on; the call is listed as not diagnosed
            self.reports.append(CallReport(info, None, error=e.render()))
            return
        apply_ignore(report.diagnosis, self.ignore)
        self.reports.append(report)

    def close(self, facts: dict) -> None:
        pass
