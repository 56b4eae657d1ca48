"""``cudnn``: cuDNN's SDPA forward as PyTorch's CUDNN_ATTENTION backend runs it, and its padded-tile hazard.

The cuDNN kernel is closed source: **every rounding point below is ASSUMED, not read.** What is public is the
algorithm (NVIDIA/cudnn-frontend@0512390c9de2905a46967d21f761eeeec8fddf1b docs/operations/Attention.md:
line 9, "using the FlashAttention-2 algorithm"; the C++ API's comments: softmax_stats "max + ln(sum_exp)"
by default, base 2 with set_stats_use_log2; set_unfuse_fma "Use unfused mul/add in the softmax
computation", set_logit_max / set_score_sum_exp output the max and the sum of exps) and what
PyTorch hands it (pytorch/pytorch@001f694aef6f922b4fdf6d27d59162d27bf3df58
aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, ``can_use_cudnn_attention``; a boolean attn_mask
becomes an additive bias in the query's dtype, ``convert_boolean_attn_mask_cudnn`` in
aten/src/ATen/native/transformers/attention.cpp: -inf since PyTorch PR 177868, -65504 before).
The emulation follows FlashAttention-2's forward with these assumed rounding points, in order:

1. S = q @ k^T from q and k in the dtype, accumulated in fp32 (tensor cores; the order of the
   fp32 sum is not known, ours is torch's matmul: a bound, not bits, on S);
2. S times the softmax scale, one fp32 multiply (the scale rounded to fp32);
3. the mask as an additive bias in the dtype (a boolean mask: 0 / -inf), added to S in fp32;
4. an online softmax over key tiles of 128 (the tile ASSUMED; the backward kernel PyTorch issue
   196678 names is ``..._sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1``) with the rounding
   points of ``attncheck.numerics.methods.online``: running max m in fp32 (a max of -inf taken as 0),
   e = exp(S - m) (the subtraction in fp32, exp correctly rounded to fp32, where the GPU's
   ``ex2.approx`` is within 2 ulp and may fold the scale into exp2), the tile sum of e a halving
   tree in fp32, l rescaled by exp(m_prev - m) each tile, fp32;
5. P = e rounded to the dtype for P @ V, accumulated in fp32 (the row sum l from the unrounded e);
6. O = acc / l (1 / l taken as 1 where l is 0 or NaN, so a row with no key gives 0), rounded to
   the dtype once. The kernel rescales acc tile by tile; the emulation multiplies each rounded P_j by
   exp(m_j - m_final) / l first (the effective probabilities) and takes P_eff @ V in fp32: the two
   differ by fp32 rounding only, so O is held to a bound, not to bits;
7. LSE = m_final + log(l), fp32 (natural log; -inf for a row with no key: ASSUMED).

The padded-tile hazard (backward; ``padded_tile_rows``). Two published triggers, both in the
backward's recompute P = exp(S - LSE) where a tile is zero-filled past the tensor's end, and both
needing a row whose forward LSE is below -ln(FLT_MAX) = -88.72 so that exp(0 - LSE) overflows fp32:

- keys (PyTorch issue 196678, torch 2.13 with cuDNN 9.20 on H100/H200, "regression since 2.11"; PyTorch
  PR 196861 upgrades to cuDNN 9.26 "to fix" it): "an explicit
  attn_mask is passed", "seq_len % 128 == 64 (fails at 64, 192, 320, ..., 704, 832, 1088, 2112; clean
  at multiples of 128 and at every other remainder tested)", "a query row's logsumexp is below about
  -88.7"; "The padded half of the last 128-wide key tile is scored 0 instead of -inf -> exp(0 - lse)
  overflows fp32, -> inf * 0 (zero-padded K) gives NaN in dQ"; "forward, grad_k, grad_v are fine";
  "cuDNN with is_causal=True and no mask tensor" is clean. cudnn-frontend PR 628 gives the cause: "the
  SM90 bprop kernel walks KV in 2-warp-group (128-row) CTA tiles but decided the out-of-bounds mask
  from the 64-row tile granularity, so for s_kv = 64 (mod 128) the TMA-zero-filled KV tail entered
  exp(0 - LSE) unmasked"; its test fails "exactly the three s = 64 (mod 128) lengths" of
  {64, 192, 1216, 1280, 1000}. So the remainder must be exactly half the tile, not any partial tile.
  NaN lands in dQ of those rows (the repro: 45056 = 704 x 64 non-finite grad_q elements, every row).
- queries (cudnn-frontend issue 1072, cuDNN 9.25.1 and 9.26, open): "Sq=1, Sk=128, D=64", "no
  padding mask", LSE "approximately -122.6 to -122.3": "dQ is finite, but dK and dV contain NaNs",
  in "every element"; controls "--padding", "--shift 0" and "--sk 97" are all finite. Here the
  padded part is the query tile (63 zero-filled query rows of a 64-row tile score 0 against every
  key); which LSE those rows read is not public. The trigger taken here, tq % 64 != 0 with
  tk % 128 == 0 and no mask needed, generalises the one observed shape (1, 128): ASSUMED.

Both were seen on sm90 (H100, H200) only; with a recorded capability other than sm90 no row is
flagged, without one (a capture that did not record it) the rows are flagged. The cuDNN version is
not part of the trigger here: the key form is fixed from 9.26 on, the query form is open at 9.26.

The issue text ("a key length that leaves a partial tile and that has an explicit mask") is wider
than the key form the threads establish (remainder exactly 64) and does not cover the query form
(Sk = 128 is a full tile; no mask). Rows whose LSE is not finite (no key) are not counted: their
NaN is the fully-masked finding's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from attncheck.numerics.paths.base import CallFacts, KernelRows, PathSpec, Stands

if TYPE_CHECKING:
    import torch

    from attncheck.numerics.inputs.scores import QKBlock
    from attncheck.numerics.methods.softmax import MethodParams
    from attncheck.numerics.paths.common import PathBlock

KEY_TILE = 128  # the key tile of the forward's online softmax and of the backward's CTA walk (ASSUMED / PR 628)
Q_TILE = 64  # the backward's query tile (the kernel name's 64x64x64; ASSUMED)
LN_FLT_MAX = math.log(3.4028234663852886e38)  # 88.72283905206835: exp(x) overflows fp32 above it
EVENT = "padded_tile"  # the hazard's event name (rows); the key and query forms as their own names too

PATH = PathSpec(
    name="cudnn",
    summary="cuDNN's SDPA forward (PyTorch's CUDNN_ATTENTION backend), emulated from its documented "
    "FlashAttention-2 algorithm: S in fp32, the mask as a bias in the dtype, online softmax over "
    "128-key tiles with fp32 statistics, P rounded to the dtype for P@V, LSE in fp32; rounding "
    "points assumed (closed source)",
    impl="attncheck.numerics.paths.cudnn:forward",
    kernel="cuDNN's SDPA forward",
    scores_in="fp32 registers (assumed)",
    probs_in="fp32",
    default=False,
    device="cuda",
    source="NVIDIA/cudnn-frontend@0512390c9de2905a46967d21f761eeeec8fddf1b docs/operations/Attention.md; "
    "pytorch/pytorch@001f694aef6f922b4fdf6d27d59162d27bf3df58 "
    "aten/src/ATen/native/transformers/cuda/sdp_utils.cpp",
    assumed="cuDNN is closed source: its rounding points (fp32 S, the bias added in fp32, the 128-key tile, "
    "exp correctly rounded, P rounded to the dtype, the halving-tree tile sum) are assumed from the "
    "documented FlashAttention-2 algorithm, not read; the padded-tile hazard's trigger is taken from "
    "PyTorch issue 196678 and cudnn-frontend issue 1072 / PR 628",
    stands_for=(Stands("sdpa", "cudnn_attention", "cuda"),),
    supports="attncheck.numerics.paths.cudnn:supports",
    replay=True,
    backward="recompute",  # a fused backward with fp32 sums, each gradient rounded once (its tiling not emulated)
    row_local=True,
)


def lse_margin(lse: torch.Tensor) -> torch.Tensor:
    """(r,) float64: how far the LSE lies below -ln(FLT_MAX) (LSE -121 -> 32.28); > 0 where exp(0 - LSE)
    overflows fp32 (up to the last fp32 rounding of exp at the boundary)."""
    return -LN_FLT_MAX - lse.double()


def padded_tile_rows(
    lse: torch.Tensor,
    tk: int,
    tq: int,
    explicit_mask: bool,
    tile: int = KEY_TILE,
    q_tile: int = Q_TILE,
    capability: tuple[int, int] | None = None,
) -> torch.Tensor:
    """(r,) bool: the rows whose backward the padded-tile hazard breaks (see the module docstring).

    A row counts where its LSE is finite and exp(0 - LSE) rounds to inf in fp32, in a call that
    leaves zero-filled entries the backward scores 0: the key form (an explicit mask and
    ``tk % tile == tile // 2``: NaN in that row's dQ) or the query form (``tq % q_tile != 0`` and
    ``tk % tile == 0``: NaN in dK and dV of every key of the head). ``capability``: the GPU's, where
    recorded; both forms were reported on sm90 only, so another recorded capability gives no row."""
    seen = capability is None or tuple(capability) == (9, 0)
    return _overflows(lse) & seen & (_key_form(tk, explicit_mask, tile) | _query_form(tk, tq, tile, q_tile))


def _key_form(tk: int, explicit_mask: bool, tile: int = KEY_TILE) -> bool:
    return bool(explicit_mask) and tk % tile == tile // 2


def _query_form(tk: int, tq: int, tile: int = KEY_TILE, q_tile: int = Q_TILE) -> bool:
    return tq % q_tile != 0 and tk % tile == 0


def _overflows(lse: torch.Tensor) -> torch.Tensor:
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    finite = torch.isfinite(lse)
    return finite & torch.isinf(torch.exp(-lse.double()).float())  # exp(0 - LSE) rounded once to fp32


def softmax_rows(s: torch.Tensor, v: torch.Tensor | None, dt: torch.dtype, tile: int = KEY_TILE):
    """The online softmax of fp32 scores ``s`` (r, Tk) (rounding points 4-7): (probs (r, Tk) float32,
    O (r, dv) in ``dt`` or None, LSE (r,) float32). ``v`` (n, Tk, dv) already in ``dt``; r = n * tq."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    from attncheck.numerics.methods.online import online_blocks

    s = s.float()
    ob = online_blocks(s, min(tile, max(1, s.shape[-1])))
    p = ob.e if dt == torch.float32 else ob.e.to(dt).float()  # P_j as P@V consumes it
    probs = ob.keys(p * ob.rescale.unsqueeze(-1))
    lse = _lse(s, ob, ob.m_run[..., -1])  # m_final: the row max (fp32), -inf for a row with no key
    out = None
    if v is not None:
        n, tk = v.shape[0], v.shape[1]
        out = torch.matmul(probs.reshape(n, -1, tk), v.float()).reshape(-1, v.shape[-1]).to(dt)
    return probs, out, lse


def _lse(s: torch.Tensor, ob, m: torch.Tensor) -> torch.Tensor:
    """LSE = m + log(l) in fp32, l the running sum of ``online_blocks`` (the same loop, fp32)."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    from attncheck.numerics.methods.online import NEG_INF, exp_f32, halving_sum

    m_run = ob.m_run
    m_safe = torch.where(m_run == NEG_INF, 0.0, m_run)
    m_prev = torch.cat([torch.full_like(m_run[..., :1], NEG_INF), m_run[..., :-1]], dim=-1)
    decay = exp_f32(m_prev - m_safe)
    block_sum = halving_sum(ob.e)
    l = torch.zeros(s.shape[:-1], dtype=torch.float32, device=s.device)
    for j in range(m_run.shape[-1]):  # over key tiles, not rows
        l = decay[..., j] * l + block_sum[..., j]
    return m + torch.log(l.double()).float()  # log rounded once to fp32; m + log(0) = -inf for no key


def kernel_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    *,
    scale: float,
    bias: torch.Tensor | None,
    dt: torch.dtype,
    tq: int | None = None,
    explicit_mask: bool | None = None,
    block_n: int = KEY_TILE,
    capability: tuple[int, int] | None = None,
) -> KernelRows:
    """The emulated cuDNN forward of q (n, tq, d), k (n, Tk, d), v (n, Tk, dv) or None (any float
    dtype; rounded to ``dt`` here), ``bias`` (n, tq, Tk) additive, in ``dt`` or rounded to it, or None.
    ``tq``: the call's query length (default q's); ``explicit_mask``: the call passed an attn_mask
    tensor (default: ``bias is not None``); ``capability``: the GPU's where known (the hazard is sm90's)."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    import torch

    from attncheck.numerics.precision import cast

    qd, kd = cast(q, dt).float(), cast(k, dt).float()
    s = torch.matmul(qd, kd.transpose(-1, -2)) * torch.tensor(scale, dtype=torch.float32)  # points 1-2
    if bias is not None:
        s = s + cast(bias, dt).float()  # point 3
    s = s.reshape(-1, s.shape[-1])
    probs, out, lse = softmax_rows(s, None if v is None else cast(v, dt), dt, block_n)
    tq = q.shape[1] if tq is None else tq
    explicit = bias is not None if explicit_mask is None else explicit_mask
    events = hazard_events(lse, k.shape[1], tq, explicit, block_n, capability)
    return KernelRows(probs, out, lse, events, margin=lse_margin(lse))


def hazard_events(
    lse: torch.Tensor,
    tk: int,
    tq: int,
    explicit_mask: bool,
    tile: int = KEY_TILE,
    capability: tuple[int, int] | None = None,
) -> dict:
    """The padded-tile hazard's rows: ``padded_tile`` (either form, ``padded_tile_rows``) and each form
    on its own ('padded_key_tile': NaN in the row's dQ; 'padded_query_tile': NaN in dK, dV)."""
    over = _overflows(lse) & (capability is None or tuple(capability) == (9, 0))
    keys = over & _key_form(tk, explicit_mask, tile)
    queries = over & _query_form(tk, tq, tile)
    return {EVENT: keys | queries, "padded_key_tile": keys, "padded_query_tile": queries}


def forward(block: QKBlock, dt: torch.dtype, methods: Sequence[str], params: MethodParams) -> PathBlock:
    """The path's forward on a block of rows: the scores as the flash path computes them (points 1-3),
    the online softmax over 128-key tiles (4-7), the padded-tile hazard as events where the registry
    knows the event's name."""
    # torch stays off --help: the registry reads this module's PATH when the CLI starts
    from attncheck.numerics.methods.softmax import MethodOutput
    from attncheck.numerics.paths.common import PathBlock
    from attncheck.numerics.precision import cast

    s, before = block.fp32_scores(dt, PATH)  # S * scale + the mask in dt, in fp32
    v = None if block.v is None else cast(block.v, dt)
    probs, o, lse = softmax_rows(s, v, dt)
    inp = block.inp
    # A captured call says whether a mask tensor or is_causal alone was given; for Q/K files any mask
    # counts as explicit (a causal-only call would be over-flagged in the key form).
    call = inp.call
    explicit = inp.mask_float is not None or inp.masked is not None if call is None else call.mask == "explicit"
    events = hazard_events(
        lse, block.k.shape[1], inp.q.shape[2], explicit, capability=None if call is None else call.capability
    )
    out = MethodOutput(probs, {EVENT: events[EVENT]}, extremes={EVENT: lse})
    out.out = o
    return PathBlock(s, before, [], [(PATH.name, out)])


# What PyTorch's cudnn backend refuses, from can_use_cudnn_attention (sdp_utils.cpp at the commit above).
def supports(facts: CallFacts) -> str | None:
    """Why PyTorch's CUDNN_ATTENTION backend would not run a call with these facts, or None."""
    if facts.dtype not in ("fp16", "bf16"):
        return f"cuDNN SDPA takes fp16 and bf16 only (check_dtypes_low_precision), not {facts.dtype}"
    cap = facts.capability
    if cap is not None and not ((8, 0) <= tuple(cap) <= (12, 1)):
        return f"cuDNN SDPA runs on sm80 to sm121 only (check_cudnn_hardware_support), not sm{cap[0]}{cap[1]}"
    if facts.head_dim % 8 or facts.head_dim_v % 8:
        return f"cuDNN SDPA needs head dims that are multiples of 8, got {facts.head_dim}/{facts.head_dim_v}"
    # 256 on sm90/sm10x with cuDNN > 9.22 and cudnn-frontend >= 1.24; 192/128 on sm90/sm10x from 9.11; else 128.
    # Without a recorded capability the widest limit is taken (the capture could have run on an H100).
    wide = cap is None or tuple(cap) == (9, 0) or cap[0] == 10
    limit = 256 if wide else 128
    if facts.head_dim > limit or facts.head_dim_v > limit:
        return f"cuDNN SDPA takes head dims up to {limit} on this device (check_cudnn_tensor_shapes)"
    if facts.dropout * 16.0 != math.floor(facts.dropout * 16.0):
        return "cuDNN SDPA's dropout resolution is 1/16 (check_cudnn_dropout)"
    if facts.tk == 1:
        return "cuDNN SDPA does not take a key length of 1 (check_cudnn_tensor_shapes)"
    if facts.dropout and facts.tq == 1:
        return "cuDNN SDPA does not take a query length of 1 with dropout (check_cudnn_tensor_shapes)"
    if facts.softcap is not None or facts.window is not None:
        return "PyTorch's SDPA has no softcap or sliding window argument to pass to cuDNN"
    return None
