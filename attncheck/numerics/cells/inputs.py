"""A captured call's inputs as its model built them: the Q/K (and V, mask) it gave its kernel, and what-if inputs
rebuilt for another dtype (a float mask's ``finfo(dtype).min`` sentinel rebuilt per dtype, a softmax call's mask read
back from its scores). ``cells.calls`` diagnoses a call from these.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from attncheck import params
from attncheck.errors import AttncheckError
from attncheck.numerics.cells.plan import call_facts, cell_dtype_name
from attncheck.numerics.inputs.scores import fit_scale, prepare_inputs
from attncheck.numerics.precision import MASK_SENTINEL_LIMIT
from attncheck.options import Options, rows_per_chunk
from attncheck.results import CallInfo
from attncheck.sources import memory_source

QK_KINDS = ("sdpa", "qk", "flex", "flash_attn")


GRAD_ROLES = (
    "grad_out",
    "grad_q",
    "grad_k",
    "grad_v",
)  # a call's output gradient and the gradients its kernel produced


def _scale(info: CallInfo) -> params.Scale:
    # repr keeps every digit: SDPA's scale is used exactly as the model passed it
    return params.Scale(repr(float(info.scale))) if info.scale is not None else params.Scale("auto")


def _scale_source(info: CallInfo) -> str | None:
    """'argument' (SDPA's scale=), 'traced' (the model's code) or 'module' (its attention module's ``scaling``):
    the model's own choice."""
    source = info.meta.get("scale_source")
    return source if source in ("argument", "traced", "module") and info.scale is not None else None


def _normalised(info: CallInfo, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """nn.MultiheadAttention's (B * H, T, ...) scores, q, k, v (and their gradients, the output) -> (B, H, T, ...)."""
    out = dict(tensors)
    scores, q, k = out.get("scores"), out.get("q"), out.get("k")
    num_heads = info.meta.get("num_heads", "")
    if (
        scores is not None
        and scores.dim() == 3
        and num_heads.isascii()
        and num_heads.isdigit()
        and int(num_heads) > 0
        and scores.shape[0] % int(num_heads) == 0
    ):
        h = int(num_heads)
        out["scores"] = scores.reshape(scores.shape[0] // h, h, *scores.shape[1:])
        if (
            q is not None
            and k is not None
            and q.dim() == 3
            and k.dim() == 3
            and q.shape[0] == k.shape[0] == scores.shape[0]
        ):
            for role in ("q", "k", "v", *GRAD_ROLES, "out"):
                t = out.get(role)
                if t is not None and t.dim() == 3 and t.shape[0] == scores.shape[0]:
                    out[role] = t.reshape(-1, h, *t.shape[1:])
    return out


def _model_inputs(info: CallInfo, tensors: dict[str, torch.Tensor], max_bytes: int | None = None):
    """Q/K inputs of an SDPA or flex call or a q/k file, as the call gave them (a flex call's
    logits after its score_mod too)."""
    inputs = prepare_inputs(
        tensors["q"],
        tensors["k"],
        tensors.get("attn_mask"),
        v=tensors.get("v"),
        scale=_scale(info),
        causal=info.is_causal,
        mask_convention="attend",
        max_bytes=max_bytes,
        logits=_flex_logits(info, tensors),
    )
    return _with_call(info, inputs)


def _with_call(info: CallInfo, inputs):
    """A captured call's inputs with what its kernel paths read: the call's facts (``plan.call_facts``: the
    mask it was given, the GPU's capability), and a flex call's key block, its BlockMask's (None without one).
    A q/k file is no captured call: it records no facts (``call_facts`` would read its mask tensor as no mask),
    so its paths get None and read the mask from the inputs themselves."""
    facts = None if info.kind == "qk" else call_facts(info, cell_dtype_name(info.dtype) or "fp32")
    inputs = replace(inputs, call=facts)
    block = info.meta.get("flex_kv_block", "")
    if info.kind == "flex" and block.isascii() and block.isdigit() and 0 < int(block) < 1 << 30:
        return replace(inputs, flex_block=int(block))
    return inputs


def _flex_logits(info: CallInfo, tensors: dict[str, torch.Tensor]):
    """A flex call's (fp32, float64) logits after its score_mod; None without one."""
    if info.kind != "flex" or "scores_mod" not in tensors:
        return None
    if "scores_mod64" not in tensors:
        raise AttncheckError("the flex call has scores_mod but no scores_mod64 (its float64 reference)")
    return tensors["scores_mod"], tensors["scores_mod64"]


def _softmax_qk(info: CallInfo, tensors: dict[str, torch.Tensor], max_bytes: int | None = None):
    """The q/k a softmax call's scores came from (traced by the capture), or None when they do not
    make these scores."""
    q, k, scores = tensors.get("q"), tensors.get("k"), tensors["scores"]
    if q is None or k is None:
        return None
    try:
        inputs = prepare_inputs(q, k, None, v=tensors.get("v"), scale=_scale(info), max_bytes=max_bytes)
    except AttncheckError:
        return None
    return inputs if tuple(inputs.score_shape) == tuple(scores.shape) else None


def _relative_float_mask(mask: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A float mask whose sentinel is ``finfo(mask.dtype).min`` as a model builds it for its dtype:
    (the rest of the mask, or None when it is all zeros; the sentinel's positions, masked in each
    dtype with that dtype's own minimum). Other masks stay as they are: (mask, None)."""
    sentinel = mask == torch.finfo(mask.dtype).min
    if not bool(sentinel.any()):
        return mask, None
    rest = torch.where(sentinel, torch.zeros((), dtype=mask.dtype), mask)
    return (None if not bool(rest.any()) else rest), sentinel


def _sdpa_what_if_inputs(info: CallInfo, tensors: dict[str, torch.Tensor], max_bytes: int | None = None):
    """An SDPA call's inputs with its mask rebuilt for each dtype (``_relative_float_mask``). Keys a
    boolean mask or ``is_causal`` masks are -inf in SDPA's kernels; ported to eager attention they
    get finfo(dtype).min added, as transformers' eager attention builds its masks."""
    mask = tensors.get("attn_mask")
    masked = None
    if mask is not None and mask.is_floating_point():
        mask, masked = _relative_float_mask(mask)
    return _with_call(
        info,
        prepare_inputs(
            tensors["q"],
            tensors["k"],
            mask,
            v=tensors.get("v"),
            scale=_scale(info),
            causal=info.is_causal,
            mask_convention="attend",
            mask_value="min" if masked is not None else "-inf",
            masked=masked,
            eager_mask_value="min",
            max_bytes=max_bytes,
            logits=_flex_logits(info, tensors),
        ),
    )


def mask_of_scores(scores: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The mask a softmax call's scores carry, read back: (masked (..., Tq, Tk) bool: -inf or at most
    the sentinel limit; the value a masked key gets in a dtype: 'min' where the masked scores sit in
    the deepest half of their dtype's range (finfo(dtype).min, added or filled: transformers' masks),
    '-inf' where every masked score is -inf, else their median as a number (-1e9, -1e4: a constant
    kept in every dtype)."""
    masked = scores <= MASK_SENTINEL_LIMIT  # -inf too
    finite = scores[masked & torch.isfinite(scores)].to(torch.float64)
    if not finite.numel():
        return masked, "-inf"
    if float(finite.max()) <= torch.finfo(scores.dtype).min / 2:
        return masked, "min"
    return masked, repr(float(finite.median()))


def _softmax_what_if_inputs(
    info: CallInfo, tensors: dict[str, torch.Tensor], inputs, options: Options, max_bytes: int | None = None
):
    """A softmax call as hand-written attention in another dtype: its q, k (and v), the scale it
    applied (traced; 1 where nn.MultiheadAttention scaled q first; else fitted to its scores), and
    the mask read back from its scores, added in each dtype (``mask_of_scores``)."""
    scores = tensors["scores"]
    if info.meta.get("q_prescaled") == "true":
        scale = params.Scale("1.0")
    elif _scale_source(info) is not None:
        scale = _scale(info)
    else:
        fitted = fit_scale(memory_source(info.name, scores), inputs, rows_per_chunk(scores.shape[-1], options))
        scale = params.Scale(repr(fitted)) if fitted is not None and fitted > 0 else _scale(info)
    masked, value = mask_of_scores(scores)
    return prepare_inputs(
        inputs.q,
        inputs.k,
        None,
        v=inputs.v,
        scale=scale,
        mask_value=value,
        masked=masked.reshape(inputs.score_shape) if bool(masked.any()) else None,
        max_bytes=max_bytes,
    )


def call_inputs(info: CallInfo, tensors: dict[str, torch.Tensor], max_bytes: int | None = None):
    """A captured call's Q, K, V and mask as the model gave them, for what-ifs that recompute the call from them
    (the KV cache's): an SDPA or flash_attn call or q/k file as recorded; a softmax call (eager attention) from the
    q, k and v traced around it, its scale and its mask read back from its scores (``_softmax_what_if_inputs``).
    None where a softmax call's q and k do not make its scores."""
    tensors = _normalised(info, tensors)
    if info.kind in QK_KINDS:
        return _model_inputs(info, tensors, max_bytes)
    inputs = _softmax_qk(info, tensors, max_bytes)
    if inputs is None:
        return None
    return _softmax_what_if_inputs(info, tensors, inputs, Options(), max_bytes)
