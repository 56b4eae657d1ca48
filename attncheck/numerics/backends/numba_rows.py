"""The row backend as fused numba kernels (CPU): the numbers of the torch backend in one
pass over each row instead of a dozen whole-tensor passes.

Nothing here imports numba until a kernel is needed. The kernels live in
``numba_kernels`` and are compiled on first use and cached on disk in the user's
cache directory (``$NUMBA_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/attncheck/numba``
or ``~/.cache/attncheck/numba``, else a folder in the temporary directory), never
inside the installed package. Where no directory is writable they are compiled in
memory on every run. Rows are processed in parallel; each row is read in key order,
so a row's values never depend on the chunking.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from attncheck import __version__
from attncheck.numerics.backends.base import AlgoReference, ChunkFacts, RowBackend, RowMetrics
from attncheck.numerics.backends.cache import cache_dir
from attncheck.numerics.backends.torch_rows import TorchRows
from attncheck.numerics.methods.fp8 import PCastRows, pcast_softmax
from attncheck.numerics.methods.softmax import MethodOutput
from attncheck.numerics.precision import MASK_SENTINEL_LIMIT, rounding_limit, smallest_subnormal, spec_of

COMPILE_NOTICE = "compiling attncheck kernels (once, ~30 s)"
KERNELS_MODULE = "attncheck.numerics.backends.numba_kernels"

_kernels = None
_warm: set[str] = set()  # kernel signatures this process has called


def installed() -> bool:
    return importlib.util.find_spec("numba") is not None


def available() -> bool:
    """numba is installed and not switched off with ATTNCHECK_KERNELS=torch (imports nothing)."""
    return os.environ.get("ATTNCHECK_KERNELS", "auto") != "torch" and installed()


def kernels():
    """The compiled-on-demand kernels module (imports numba; it points numba's cache at ``cache_dir()``)."""
    global _kernels
    if _kernels is None:
        _kernels = importlib.import_module(KERNELS_MODULE)
    return _kernels


def _stamp(signature: str) -> Path | None:
    """A file saying that this signature of the kernels was compiled into the cache: numba
    recompiles when the kernels' file changes (mtime, size), numba or Python changes."""
    folder = cache_dir()
    if folder is None:
        return None
    src = Path(importlib.util.find_spec(KERNELS_MODULE).origin)
    st = src.stat()
    # optional and slow to import: numba only once a kernel is compiled or its cache stamped
    import numba

    key = f"{src}|{st.st_mtime_ns}|{st.st_size}|{numba.__version__}|{sys.version}|{__version__}|{signature}"
    return folder / f"attncheck-{hashlib.sha1(key.encode()).hexdigest()[:16]}.stamp"


def call(name: str, signature: str, *args, notice: Callable[[str], None] | None = None):
    """Call kernel ``name``; on a signature not yet in the disk cache, tell ``notice`` first."""
    key = f"{name}:{signature}"
    stamp = None
    if key not in _warm:
        stamp = _stamp(key)
        if notice is not None and (stamp is None or not stamp.exists()) and not _warm:
            notice(
                COMPILE_NOTICE
                if stamp is not None
                else "compiling attncheck kernels (~30 s; no writable cache directory, so every run compiles)"
            )
    out = getattr(kernels(), name)(*args)
    if key not in _warm:
        _warm.add(key)
        if stamp is not None and not stamp.exists():
            try:
                stamp.touch()
            except OSError:
                pass
    return out


def view(x: torch.Tensor) -> str | None:
    """How the kernels read a tensor's elements (the registry's kernel_view), or None."""
    spec = spec_of(x.dtype)
    return None if spec is None else spec.kernel_view


def as_rows(x: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a C-contiguous numpy array without conversion: fp32/fp64 as they
    are, fp16 as its uint16 bit patterns and bf16 as int16 ones (the kernels widen both)."""
    kind = view(x)
    if kind is None:
        raise ValueError(f"the fused kernels do not read {x.dtype}")
    x = x.detach().contiguous()
    if x.element_size() == 2:
        return x.view(torch.int16).numpy().view(np.dtype(kind))
    return x.numpy()


class Workspace:
    """float64 buffers the kernels write into, reused from chunk to chunk. A fresh buffer
    of 32 MiB or more is a new mapping whose pages fault in again on every chunk; reuse
    makes that once per diagnosis. A buffer taken under a name is valid until the name is
    taken again."""

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype=np.float64) -> np.ndarray:
        n = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.size < n or buf.dtype != dtype:
            buf = self._buffers[name] = np.empty(n, dtype=dtype)
        return buf[:n].reshape(shape)


class NumbaRows(RowBackend):
    name = "numba"

    def __init__(self, notice: Callable[[str], None] | None = None) -> None:
        self.notice = notice
        self.workspace = Workspace()
        self._torch = TorchRows()

    def _call(self, name: str, signature: str, *args):
        return call(name, signature, *args, notice=self.notice)

    def chunk(self, x: torch.Tensor, offset: int, shift: float) -> ChunkFacts:
        # fp16/bf16 scores widen exactly to fp32: one compiled kernel fewer per dtype
        xn = as_rows(x if x.dtype in (torch.float32, torch.float64) else x.float())
        ref = self.workspace.take("ref", xn.shape)
        out = self._call("reference_rows", str(xn.dtype), xn, shift, MASK_SENTINEL_LIMIT, ref)
        nan, posinf, neginf, masked, finite, fmax, fmin, umin, s1, s2, ssum, ent, jac, pos, top = (
            torch.from_numpy(a) for a in out
        )
        return ChunkFacts(
            x,
            offset,
            nan,
            posinf,
            neginf,
            masked,
            finite,
            fmax,
            fmin,
            umin,
            s1,
            s2,
            torch.from_numpy(ref),
            ssum,
            ent,
            jac,
            pos,
            top.unsqueeze(-1),
        )

    def algo_reference(self, xc: torch.Tensor) -> AlgoReference:
        ref = self.workspace.take("algo_ref", tuple(xc.shape))
        xn = as_rows(xc)
        ok = self._call("algo_reference_rows", str(xn.dtype), xn, ref)
        return AlgoReference(xc, torch.from_numpy(ok), torch.from_numpy(ref), same=False)

    def method(self, spec, algo: AlgoReference, params):
        """``tiled`` (P cast included) by the fused kernel ``tiled_rows``: the probabilities
        bit for bit as ``softmax.tiled_softmax`` / ``fp8.pcast_softmax`` give them, written
        into a reused buffer, and for FP8 cells the P cast's counts per row. Rows holding
        NaN or +inf (rare) are computed by the torch implementation."""
        xc = algo.xc
        if spec.rows_kernel != "tiled_rows" or xc.dim() != 2 or view(xc) is None or not xc.shape[-1]:
            return None
        fp8 = params.fp8
        if fp8 is None:
            return MethodOutput(self.online(xc, xc.dtype, params.block, params.reverse))
        r, t = xc.shape
        block = min(params.block, t)
        fmt, p_scale = fp8.fmt, float(fp8.p_scale)
        limit = rounding_limit(fmt) if p_scale >= rounding_limit(fmt) else math.inf
        done, overflow, live, flushed, mass, probs = self._tiled(
            xc, block, params.reverse, fmt, True, p_scale, limit, algo.ref.numpy(), algo.ok.numpy()
        )
        rest = torch.nonzero(~done).flatten()
        if rest.numel():
            sub = pcast_softmax(xc[rest], fmt, p_scale, block, params.reverse)
            probs[rest] = sub.probs
            overflow[rest] = sub.overflow
        return MethodOutput(probs, pcast=PCastRows(live, flushed, mass, overflow, p_scale))

    def online(self, x: torch.Tensor, p_dtype: torch.dtype, block: int, reverse: bool = False) -> torch.Tensor:
        """The online softmax by ``tiled_rows`` (the same bits as ``methods.online``), into a reused
        buffer; rows holding NaN or +inf by the torch implementation."""
        if x.dim() != 2 or view(x) is None or not x.shape[-1] or x.device.type != "cpu":
            return super().online(x, p_dtype, block, reverse)
        block = min(block, x.shape[-1])
        done, *_, probs = self._tiled(
            x, block, reverse, p_dtype, False, 1.0, math.inf, np.zeros((1, 1)), np.zeros(x.shape[0], np.bool_)
        )
        rest = torch.nonzero(~done).flatten()
        if rest.numel():
            probs[rest] = super().online(x[rest], p_dtype, block, reverse)
        return probs

    def _tiled(self, x, block, reverse, fmt, fp8, p_scale, limit, ref, ref_ok):
        mb, emin, top = format_of(fmt)
        out = self.workspace.take("tiled", tuple(x.shape), np.float32)
        xn = as_rows(
            x if x.dtype == torch.float32 else x.float()
        )  # widened exactly: one compiled kernel, not one per dtype
        done, overflow, live, flushed, mass = (
            torch.from_numpy(a)
            for a in self._call(
                "tiled_rows",
                f"{xn.dtype}",
                xn,
                block,
                bool(reverse),
                mb,
                emin,
                top,
                fp8,
                p_scale,
                limit,
                ref,
                ref_ok,
                out,
            )
        )
        return done, overflow, live, flushed, mass, torch.from_numpy(out)

    def cell_metrics(
        self, c: ChunkFacts, probs: Sequence[torch.Tensor], algo: AlgoReference, precise: bool = False
    ) -> list[RowMetrics]:
        """One kernel call for every cell whose probabilities are in the scores' dtype or in
        fp32 (any number of them), reading each row of the references once; others, if any,
        through the torch backend. ``precise`` selects the kernel's short KL series (see
        ``numba_kernels._metrics``)."""
        xdt = algo.xc.dtype
        group_a = [i for i, p in enumerate(probs) if p.dtype == xdt and view(p) is not None]
        group_b = [i for i, p in enumerate(probs) if p.dtype != xdt and p.dtype == torch.float32]
        rest = [i for i in range(len(probs)) if i not in group_a and i not in group_b]
        out: list[RowMetrics | None] = [None] * len(probs)
        if group_a or group_b:
            arrays_a = [
                as_rows(probs[i]) for i in group_a
            ]  # kept alive across the call: the kernel reads their addresses
            arrays_b = [as_rows(probs[i]) for i in group_b]
            like_a = as_rows(algo.xc[:1, :1])
            like_b = np.zeros((1, 1), np.float32)
            floors = np.array([smallest_subnormal(probs[i].dtype) for i in group_a + group_b])
            result = self._call(
                "cell_rows",
                f"{like_a.dtype}+{like_b.dtype}",
                _addresses(arrays_a),
                like_a,
                _addresses(arrays_b),
                like_b,
                floors,
                algo.ref.numpy(),
                not algo.same,
                algo.ok.numpy(),
                c.ref.numpy(),
                c.ref_ok.numpy(),
                c.ref_top.squeeze(-1).numpy(),
                bool(precise),
            )
            del arrays_a, arrays_b
            fields = [torch.from_numpy(a) for a in result]
            for slot, i in enumerate(group_a + group_b):
                pmax, psum, sq, mx, sqa, mxa, kl, flushed, attop = (f[slot] for f in fields)
                out[i] = RowMetrics(
                    pmax, psum, sq, mx, None if algo.same else sqa, None if algo.same else mxa, kl, flushed, attop
                )
        if rest:
            for i, m in zip(rest, self._torch.cell_metrics(c, [probs[i] for i in rest], algo)):
                out[i] = m
        return out  # type: ignore[return-value]


def format_of(dt: torch.dtype) -> tuple[int, int, float]:
    """How the kernels round P to ``dt``: mantissa bits, exponent of the smallest normal, the
    largest finite value; mantissa bits -1 for float32 (P is kept as it is)."""
    if dt == torch.float32:
        return -1, 0, math.inf
    fi = torch.finfo(dt)
    emin = round(math.log2(fi.tiny))
    mb = round(math.log2(fi.tiny / smallest_subnormal(dt)))  # subnormals: the spacing 2^(emin - mb)
    return mb, emin, float(fi.max)


def _addresses(arrays: list[np.ndarray]) -> np.ndarray:
    return np.array([a.ctypes.data for a in arrays], dtype=np.int64)
