"""Where recorded calls go: a capture directory, memory, or a diagnosis on the fly.

A capture directory holds one ``.safetensors`` per call (``NNNN-<module>.safetensors``, its
metadata in the header) and ``manifest.json``. Writing never leaves the directory: file
names are made from the call index and a sanitised module path, and an existing directory
is reused only when it is empty or holds a previous capture (whose own files are replaced).
"""

from __future__ import annotations

import json
import os
import queue
import struct
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from attncheck import __version__
from attncheck.devices import resolve_device
from attncheck.errors import AttncheckError
from attncheck.findings import apply_ignore
from attncheck.judge import diagnose_call
from attncheck.loaders import jsondoc
from attncheck.loaders.calls import CALL_FILE, CAPTURE_SCHEMA, MANIFEST, call_file_name, grads_file_name, info_from_meta
from attncheck.loaders.rope import ROPE_FILE, rope_file_name
from attncheck.numerics.rope_qk import RotatedQK
from attncheck.record.ops import Recorded, Sink
from attncheck.record.ranks import OWNER, RANK_DIR, claim, release
from attncheck.results import CallInfo, CallReport


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


# safetensors' names of the dtypes a call can hold
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.bool: "BOOL",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
}


PART = ".part"  # a call file being written: renamed to its name once whole


def write_safetensors(path: str | os.PathLike[str], tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write a .safetensors file straight from the tensors' memory (no intermediate copy): an
    8-byte little-endian header length, the JSON header padded to 8 bytes, the data in order.
    Tensors must be contiguous CPU tensors; other dtypes or a big-endian host use safetensors'
    own writer."""
    if sys.byteorder != "little" or any(t.dtype not in SAFETENSORS_DTYPES for t in tensors.values()):
        save_file(tensors, str(path), metadata=metadata)
        return
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)))
        fh.write(text)
        for t in tensors.values():
            if t.numel():
                fh.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def prepare_directory(path: str | os.PathLike[str], rank: int | None = None) -> tuple[Path, Path, bool]:
    """The capture directory, created (its parent must exist), claimed by this process (``ranks.claim``:
    a directory another live process writes is refused) and emptied of a previous capture; as an
    absolute path, so that a script that changes its working directory still writes there; and the
    owner file to release when done; and whether a previous capture was there (its files are now gone)."""
    d = Path(os.path.abspath(path))
    owner = None
    try:
        _create(d)
        owner = claim(d, rank)
        d, replaced = _prepare(d)
        return d, owner, replaced
    except OSError as e:  # a name the file system refuses (too long), a folder removed meanwhile
        if owner is not None:
            release(owner)
        raise AttncheckError(f"cannot use capture directory {path}: {e.strerror or e}", param="path") from None
    except AttncheckError:
        if owner is not None:
            release(owner)
        raise


def _create(d: Path) -> None:
    if d.exists() and not d.is_dir():
        raise AttncheckError(f"capture directory {d} is a file", param="path")
    if not d.exists():
        if not d.parent.is_dir():
            raise AttncheckError(f"cannot create capture directory {d}: folder {d.parent} does not exist", param="path")
        try:
            d.mkdir(exist_ok=True)
        except OSError as e:
            raise AttncheckError(f"cannot create capture directory {d}: {e.strerror or e}", param="path") from None


def _prepare(d: Path) -> tuple[Path, bool]:
    entries = [p for p in d.iterdir() if p.name != OWNER]
    if not entries:
        return d, False
    ranks = [p for p in entries if p.is_dir() and p.name.startswith(RANK_DIR.format("")) and (p / MANIFEST).is_file()]
    if ranks and not (d / MANIFEST).is_file():
        raise AttncheckError(
            f"capture directory {d} holds a capture of several processes (rank0, rank1, ...: "
            "torchrun); give a new or empty folder",
            param="path",
        )
    manifest = d / MANIFEST
    own = [
        p
        for p in entries
        if p.is_file()
        and not p.is_symlink()
        and (CALL_FILE.match(p.name.removesuffix(PART)) or p.name == MANIFEST + ".tmp")
    ]
    if not manifest.is_file() and len(own) == len(entries):
        # a capture that did not finish (killed: its writer is gone, ``claim`` took its owner file over): its own
        # files alone, replaced as a finished capture's are
        for p in own:
            p.unlink()
        return d, True
    if not manifest.is_file():
        raise AttncheckError(
            f"capture directory {d} is not empty and holds no capture ({MANIFEST}); give a new or empty folder",
            param="path",
        )
    try:
        with open(manifest, "rb") as fh:
            doc = jsondoc.decode(fh.read(jsondoc.MAX_BYTES + 1))
    except (OSError, jsondoc.JSONError):
        doc = None
    if (
        not isinstance(doc, dict)
        or not isinstance(doc.get("schema"), str)
        or not doc["schema"].startswith("attncheck.capture/")
    ):
        raise AttncheckError(
            f"capture directory {d} is not empty and its {MANIFEST} is not a capture's; give a new or empty folder",
            param="path",
        )
    for p in entries:  # a previous capture: its own files go, anything else stays
        if p.is_file() and (p.name == MANIFEST or CALL_FILE.match(p.name) or ROPE_FILE.match(p.name)):
            p.unlink()
    return d, True


class DirectorySink(Sink):
    """Writes each call to its file, the manifest at the end.

    Each call's tensors are copied as they are recorded and written by a background thread
    while the model runs on; at most two calls' tensors are held at once (one being written,
    the next waits for it), so memory does not grow with the capture.
    """

    IN_FLIGHT = 1

    def __init__(self, path: str | os.PathLike[str], rank: int | None = None) -> None:
        self.dir, self._owner, self.replaced = prepare_directory(path, rank)  # replaced: a previous capture was there
        self.entries: list[dict] = []
        self.rope_tables: list[dict] = []
        self.bytes = 0
        self._slots = threading.Semaphore(self.IN_FLIGHT)
        # Staging buffers written out are reused for the next call of the same shape: copying into
        # memory already mapped costs no page faults (a model's calls mostly share their shapes).
        self._spare: dict[tuple, list[torch.Tensor]] = {}
        self._spare_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._error: AttncheckError | None = None
        self._failed: set[str] = set()
        self._thread = threading.Thread(target=self._write_calls, name="attncheck-capture-writer", daemon=True)
        self._thread.start()

    def __call__(self, call: Recorded) -> None:
        if self._error is not None:
            raise self._error
        name = call_file_name(call.index, call.module)
        self._slots.acquire()  # wait until the previous call is written
        if self._error is not None:  # that write may have failed while this call waited
            self._slots.release()
            raise self._error
        tensors = {role: self._stage(t) for role, t in call.tensors.items()}  # copies: the model may reuse its buffers
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        self.bytes += size
        self.entries.append(
            {
                "index": call.index,
                "file": name,
                "kind": call.kind,
                "module": call.module,
                "forward": call.forward,
                "bytes": size,
                "tensors": {
                    role: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                    for role, t in tensors.items()
                },
                **({"kv_base": int(call.meta["kv_base"])} if "kv_base" in call.meta else {}),
                **({"kv_drop": int(call.meta["kv_drop"])} if "kv_drop" in call.meta else {}),
                **({"rope": int(call.meta["rope"])} if "rope" in call.meta else {}),
            }
        )
        self._queue.put((self.dir / name, tensors, dict(call.meta)))

    def rope(self, index: int, tensors: dict[str, torch.Tensor], facts: dict[str, str]) -> None:
        """A rotary table, the first time a call runs under it: written at once (a few KiB to MiB), listed in the
        manifest's ``rope_tables``."""
        name = rope_file_name(index)
        staged = {role: t.detach().contiguous().cpu() for role, t in tensors.items()}
        try:
            write_safetensors(self.dir / name, staged, {"format": CAPTURE_SCHEMA, "rope": str(index), **facts})
        except OSError as e:
            raise AttncheckError(f"cannot write {self.dir / name}: {e.strerror or e}") from None
        cos = staged["cos"]
        entry = {"index": index, "file": name, "shape": list(cos.shape), "dtype": str(cos.dtype).removeprefix("torch.")}
        if "theta" in facts:
            entry["theta"] = float(facts["theta"])
        entry["rope_type"] = facts.get("rope_type", "default")
        entry["positions"] = "positions" in staged
        if "parameters" in facts:  # the type's parameters (factor, ...), as rope_facts wrote them
            entry["parameters"] = json.loads(facts["parameters"])
        self.rope_tables.append(entry)

    def grads(self, call: Recorded, tensors: dict[str, torch.Tensor]) -> None:
        """A call's gradients, as the backward reached it: written to ``NNNN-<module>.grads.safetensors``
        beside the call's file, and listed in its manifest entry."""
        if self._error is not None:
            raise self._error
        entry = next((e for e in self.entries if e["index"] == call.index), None)
        if entry is None:
            return
        name = grads_file_name(call.index, call.module)
        self._slots.acquire()
        if self._error is not None:
            self._slots.release()
            raise self._error
        staged = {role: self._stage(t) for role, t in tensors.items()}
        size = sum(t.numel() * t.element_size() for t in staged.values())
        entry["grads"] = {
            "file": name,
            "bytes": size,
            "tensors": {
                role: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                for role, t in staged.items()
            },
        }
        self.bytes += size
        meta = {"format": CAPTURE_SCHEMA, "call": str(call.index), "module": call.module, "grads": "true"}
        self._queue.put((self.dir / name, staged, meta))

    def _write_calls(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            path, tensors, meta = item
            del item
            try:
                if self._error is None:  # written whole under a name no reader takes, then renamed: a capture
                    part = path.with_name(path.name + PART)  # killed mid-write leaves no half call file
                    write_safetensors(part, tensors, meta)
                    os.replace(part, path)
                else:  # recording has stopped: this call is not written, so the manifest must not list it
                    self._failed.add(path.name)
            except OSError as e:
                self._error = AttncheckError(f"cannot write {path}: {e.strerror or e}")
                self._failed.add(path.name)
            finally:
                with self._spare_lock:
                    for t in tensors.values():
                        spare = self._spare.setdefault((tuple(t.shape), t.dtype), [])
                        if len(spare) < self.IN_FLIGHT:
                            spare.append(t)
                del tensors
                self._slots.release()

    def _stage(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous CPU copy of ``t``, in a reused buffer where one of its shape is free."""
        with self._spare_lock:
            spare = self._spare.get((tuple(t.shape), t.dtype))
            buf = spare.pop() if spare else None
        if buf is None:
            buf = torch.empty(t.shape, dtype=t.dtype)
        return buf.copy_(t.detach())

    @property
    def error(self) -> str | None:
        """Why a call could not be written (recording stopped there), or None."""
        return None if self._error is None else self._error.message

    def close(self, facts: dict) -> None:
        """Wait for the last write, then write the manifest (calls that failed to write left out), and give
        the directory up."""
        try:
            self._close(facts)
        finally:
            release(self._owner)

    def _close(self, facts: dict) -> None:
        self._queue.put(None)
        self._thread.join()
        failed = [e for e in self.entries if e["file"] in self._failed]
        if failed and not facts.get("first_unrecorded"):
            e = failed[0]
            first = {"index": e["index"], "kind": e["kind"], "module": e["module"], "what": "call"}
            facts = {**facts, "first_unrecorded": first}
        self.entries = [e for e in self.entries if e["file"] not in self._failed]
        for e in self.entries:
            if "grads" in e and e["grads"]["file"] in self._failed:
                del e["grads"]
        self.bytes = sum(e["bytes"] + e.get("grads", {}).get("bytes", 0) for e in self.entries)
        if self._error is not None:
            facts = {**facts, "complete": False, "stopped": facts.get("stopped") or self._error.message}
        doc = {
            "schema": CAPTURE_SCHEMA,
            "attncheck_version": __version__,
            "torch_version": torch.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **facts,
            "total_bytes": self.bytes,
            "calls": self.entries,
            **({"rope_tables": self.rope_tables} if self.rope_tables else {}),
        }
        tmp = self.dir / (MANIFEST + ".tmp")
        try:
            tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
            os.replace(tmp, self.dir / MANIFEST)
        except OSError as e:  # the disk filled up, or the script removed the folder while it ran
            gone = "" if self.dir.is_dir() else f" (the folder {self.dir} is gone: removed while the script ran?)"
            raise AttncheckError(
                f"cannot write the capture's manifest {self.dir / MANIFEST}: {e.strerror or e}{gone}", param="path"
            ) from None


class MemorySink(Sink):
    """Keeps every call, its tensors copied to the CPU as they are recorded."""

    def __init__(self) -> None:
        self.calls: list[Recorded] = []
        self.rope_tables: dict[int, dict] = {}  # number -> {'tensors': cos, sin (positions), 'facts'}

    def rope(self, index: int, tensors: dict[str, torch.Tensor], facts: dict[str, str]) -> None:
        self.rope_tables[index] = {"tensors": cpu_tensors(tensors, copy=True), "facts": dict(facts)}

    def __call__(self, call: Recorded) -> None:
        self.calls.append(
            Recorded(
                call.index, call.kind, call.module, call.forward, cpu_tensors(call.tensors, copy=True), dict(call.meta)
            )
        )

    def grads(self, call: Recorded, tensors: dict[str, torch.Tensor]) -> None:
        kept = next((c for c in self.calls if c.index == call.index), None)
        if kept is not None:
            kept.tensors.update(cpu_tensors(tensors, copy=True))

    def close(self, facts: dict) -> None:
        pass


class DiagnoseSink(Sink):
    """Diagnoses each call as it comes and keeps only the result."""

    def __init__(self, options, ignore=(), notice: Callable[[str], None] | None = None, what_if=(), asked=None) -> None:
        self.options = replace(options, device=str(resolve_device(options.device)))
        self.ignore, self.notice = tuple(ignore), notice
        self.what_if, self.asked = tuple(what_if), asked
        self.reports = []
        self.rank: int | None = None  # under torchrun: each call's report names this process's rank
        self._waiting: dict[int, Recorded] = {}  # calls whose gradients are still to come
        self._order: list[int] = []
        self.rope_tables: dict[int, dict] = {}  # the rotary tables, as ``loaders.rope`` reads them from a directory

    def rope(self, index: int, tensors: dict[str, torch.Tensor], facts: dict[str, str]) -> None:
        kept = cpu_tensors(tensors, copy=True)
        self.rope_tables[index] = {
            "index": index,
            "cos": kept["cos"],
            "sin": kept["sin"],
            "positions": kept.get("positions"),
            "theta": float(facts["theta"]) if "theta" in facts else None,
            "rope_type": facts.get("rope_type", "default"),
            "parameters": json.loads(facts["parameters"]) if "parameters" in facts else {},
            "calls": [],
            "modules": [],
        }
        table = self.rope_tables[index]  # its calls' rotated q and k, judged as each comes (none is kept)
        table["qk"] = RotatedQK(table["cos"], table["sin"], table["positions"], table["theta"], table["rope_type"])

    def __call__(self, call: Recorded) -> None:
        table = self.rope_tables.get(int(call.meta["rope"])) if "rope" in call.meta else None
        if table is not None:
            table["calls"].append(call.index)
            if (call.module or "global") not in table["modules"]:
                table["modules"].append(call.module or "global")
            table["qk"].add(call.index, call.tensors.get("q"), call.tensors.get("k"))
        if call.expects_grads:  # its gradients come with the backward: diagnosed then, or when the capture ends
            self._waiting[call.index] = Recorded(
                call.index, call.kind, call.module, call.forward, cpu_tensors(call.tensors, copy=True), dict(call.meta)
            )
            self._order.append(call.index)
            return
        self._order.append(call.index)
        self._diagnose(call)

    def grads(self, call: Recorded, tensors: dict[str, torch.Tensor]) -> None:
        kept = self._waiting.pop(call.index, None)
        if kept is not None:
            kept.tensors.update(cpu_tensors(tensors, copy=True))
            self._diagnose(kept)

    def _diagnose(self, call: Recorded) -> None:
        name = f"{call.index:04d}-{call.module or 'global'}"
        try:
            info = info_from_meta(call.meta, index=call.index, name=name, file=None)
        except AttncheckError as e:  # a call attncheck cannot diagnose (a negative scale): listed, the model runs on
            info = CallInfo(index=call.index, name=name, kind=call.kind, module=call.module)
            info.rank = self.rank
            self.reports.append(CallReport(info, None, error=f"{name} (call {call.index}, {call.kind}): {e.message}"))
            return
        info.rank = self.rank
        tensors = cpu_tensors(call.tensors, copy=False)
        device_type = next(iter(call.tensors.values())).device.type
        try:
            with (
                torch.no_grad(),
                torch.autocast(device_type=device_type, enabled=False),
            ):  # the diagnosis computes in the dtypes it names
                report = diagnose_call(
                    info, tensors, self.options, notice=self.notice, what_if=self.what_if, asked=self.asked
                )
        except AttncheckError as e:  # the model runs on; the call is listed as not diagnosed
            self.reports.append(CallReport(info, None, error=e.render()))
            return
        apply_ignore(report.diagnosis, self.ignore)
        if report.what_if is not None:
            apply_ignore(report.what_if, self.ignore)
        self.reports.append(report)

    def close(self, facts: dict) -> None:
        """Diagnose the calls whose backward never came (or came after the capture), then keep the reports in call
        order."""
        for index in list(self._waiting):
            self._diagnose(self._waiting.pop(index))
        order = {index: i for i, index in enumerate(self._order)}
        self.reports.sort(key=lambda r: order.get(r.call.index, len(order)))
