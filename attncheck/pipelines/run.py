"""``attncheck run`` as a library call: a ``RunRequest`` in, a ``RunResult`` out.

Score files stream in row blocks within ``options.chunk_elements``; Q, K and a mask
are loaded whole and their scores computed per dtype in row blocks.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Callable

import torch

from attncheck.config.run import QKSpec, RunRequest
from attncheck.errors import AttncheckError, param
from attncheck.results import RunResult, TensorDiagnosis

Track = Callable[[str, int], "Callable[[int], None] | None"]  # (tensor name, rows) -> rows-done callback


def run(request: RunRequest, track: Track | None = None, notice: Callable[[str], None] | None = None) -> RunResult:
    """Diagnose every tensor the request names; ``track`` gives a progress callback per tensor,
    ``notice`` hears one line before the fused kernels compile for the first time."""
    from attncheck.loaders import open_sources
    from attncheck.numerics.diagnose import diagnose, diagnose_chunks, resolve_device, rows_per_chunk

    track = track or (lambda name, rows: None)
    dev = resolve_device(request.options.device)
    options = replace(request.options, device=str(dev))  # 'auto' -> where it runs, as the report says
    budget = request.max_memory
    if request.qk is not None:
        sources = open_sources(request.paths, request.keys, max_bytes=budget) if request.paths else []
        diags = _run_qk(request.qk, sources, options, track, notice, budget)
    elif request.example:
        from attncheck.demo import EXAMPLE_NAME, example_scores

        x = example_scores()
        diags = [diagnose(EXAMPLE_NAME, x, options, track(EXAMPLE_NAME, x.numel() // x.shape[-1]), notice)]
    else:
        diags = []
        for src in open_sources(request.paths, request.keys, max_bytes=budget):  # headers only: each tensor streams in row chunks
            blocks = src.row_blocks(rows_per_chunk(src.shape[-1], options))
            diags.append(diagnose_chunks(src.name, src.shape, src.dtype, blocks, options, track(src.name, src.rows), notice=notice))
    return RunResult(diags, device_label(dev))


def device_label(dev: torch.device) -> str:
    """'cpu', or 'cuda:0 (NVIDIA H100 ...)'."""
    label = str(dev)
    if dev.type == "cuda":
        label += f" ({torch.cuda.get_device_name(dev)})"
    return label


def split_spec(spec: str) -> tuple[str, str | None]:
    """PATH or PATH:KEY -> (path, key): the key starts after the first ':' at which the part
    before it names an existing file (keys may hold ':' themselves), else after the last."""
    if _exists(spec) or ":" not in spec:
        return spec, None
    cuts = [i for i, ch in enumerate(spec) if ch == ":"]
    for i in cuts:
        if _exists(spec[:i]):
            return spec[:i], spec[i + 1 :]
    return spec[: cuts[-1]], spec[cuts[-1] + 1 :]


def _exists(path: str) -> bool:
    try:
        return os.path.isfile(path)
    except (OSError, ValueError):
        return False


def load_one(spec: str, name: str, kind: str = "scores", max_bytes: int | None = None) -> tuple[str, torch.Tensor]:
    """PATH or PATH:KEY -> (name, tensor); the file must hold exactly one selected tensor.
    ``name`` is the parameter the spec was given as (q, k, mask)."""
    from attncheck.loaders import load_tensors

    path, key = split_spec(spec)
    found = load_tensors([path], [key] if key else [], kind=kind, max_bytes=max_bytes)
    if len(found) != 1:
        names = ", ".join(t.name for t in found[:6])
        raise AttncheckError(f"{param(name)} {spec} selects {len(found)} tensors ({names}); pick one with {param(name)} PATH:KEY")
    return found[0].name, found[0].tensor


def _run_qk(qk: QKSpec, sources, options, track: Track, notice, max_bytes: int | None = None) -> list[TensorDiagnosis]:
    from attncheck.numerics.diagnose import diagnose_attention
    from attncheck.numerics.scores import prepare_inputs

    q_name, q = load_one(qk.q, "q", max_bytes=max_bytes)
    k_name, k = load_one(qk.k, "k", max_bytes=max_bytes)
    v = load_one(qk.v, "v", max_bytes=max_bytes)[1] if qk.v else None
    mask = load_one(qk.mask, "mask", "mask", max_bytes)[1] if qk.mask else None
    boolean = mask is not None and mask.dtype == torch.bool
    if qk.mask_convention is not None and not boolean:
        raise AttncheckError(f"{param('mask_convention')} applies to a boolean {param('mask')}" + (f"; {qk.mask} is {str(mask.dtype).removeprefix('torch.')}" if mask is not None else ", which is not given"))
    if qk.mask_value is not None and not (boolean or qk.causal or qk.pad_left or qk.pad_right):
        raise AttncheckError(f"{param('mask_value')} is what keys masked by a boolean {param('mask')}, {param('causal')} or {param('pad_left')}/{param('pad_right')} become; none is given"
                             + (" (a float mask carries its own values)" if mask is not None else ""))
    inputs = prepare_inputs(
        q, k, mask, v=v,
        scale=qk.scale, scale_order=qk.scale_order, causal=qk.causal,
        pad_left=list(qk.pad_left), pad_right=list(qk.pad_right),
        mask_value=qk.mask_value or "-inf", mask_convention=qk.mask_convention or "attend", max_bytes=max_bytes,
    )
    if sources:  # scores given too: diagnose them and fit the scale they carry
        return [diagnose_attention(src.name, inputs, options, track(src.name, src.rows), scores=src, notice=notice) for src in sources]
    name = f"{q_name} @ {k_name}"
    return [diagnose_attention(name, inputs, options, track(name, inputs.rows), notice=notice)]
