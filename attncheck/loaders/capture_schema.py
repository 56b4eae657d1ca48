"""What a capture directory may say, as typed structs: the manifest (``manifest.json``) and each
call file's metadata (strings in its safetensors header). Every field a reader uses has its type,
range and size here, checked by ``jsondoc`` before anything is used; fields this version does not
know are ignored, so a newer writer's optional fields (gradients, mask kinds) read fine. To add
one: a field with a default.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from msgspec import Meta, Struct

CAPTURE_SCHEMA_PREFIX = "attncheck.capture/"
MAX_CALLS = 100_000  # calls one manifest may list (capture's --max-calls is 1000 by default)
MAX_INDEX = 10**9
MAX_NAME = 4096  # characters of a module path or a script argument
MAX_TEXT = 1 << 16  # characters of a message (why recording stopped, the script's error)
MAX_AXES = 16
MAX_DIM = 1 << 48
MAX_ROLES = 64
MAX_BYTES = 1 << 62

Index = Annotated[int, Meta(ge=0, le=MAX_INDEX)]
Count = Annotated[int, Meta(ge=0, le=MAX_BYTES)]
Name = Annotated[str, Meta(max_length=MAX_NAME)]
Message = Annotated[str, Meta(max_length=MAX_TEXT)]
Short = Annotated[str, Meta(max_length=128)]
Schema = Annotated[str, Meta(pattern=r"^attncheck\.capture/", max_length=64)]
# 'flash_attn': a call of the flash-attn package (FlashAttention-2, -3 or -4's Python interface), patched to record it
Kind = Literal["sdpa", "softmax", "flex", "flash_attn"]
Role = Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_.]{0,63}$")]
Dim = Annotated[int, Meta(ge=0, le=MAX_DIM)]
# The dtypes a call is computed in (torch's names, as the recorder writes them); attncheck reads
# calls in these. FP8 and integer calls are refused by name.
ComputeDtype = Literal["float16", "bfloat16", "float32", "float64"]
# SDPA's scale multiplies q.k: attncheck diagnoses positive finite ones (float64's largest is the bound).
Scale = Annotated[float, Meta(gt=0.0, le=1.7976931348623157e308)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
Capability = Annotated[str, Meta(pattern=r"^[0-9]{1,3}\.[0-9]{1,3}$")]  # a CUDA compute capability: '9.0'
ImplName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
Window = Annotated[str, Meta(pattern=r"^-?[0-9]{1,12},-?[0-9]{1,12}$")]  # 'left,right' in keys; -1: unbounded
Descales = Annotated[str, Meta(pattern=r"^(none|[qkv](,[qkv]){0,2})$")]  # which of q, k, v had a descale factor


class ManifestTensor(Struct):
    shape: Annotated[list[Dim], Meta(max_length=MAX_AXES)]
    dtype: Optional[Short] = None


class ManifestGrads(Struct):
    """A call's gradients file (written when the backward reached the call)."""

    file: Name  # NNNN-<module>.grads.safetensors: checked by the reader
    bytes: Optional[Count] = None
    tensors: Annotated[dict[Role, ManifestTensor], Meta(max_length=MAX_ROLES)] = {}


class ManifestCall(Struct):
    index: Index
    file: Name  # a call file of the directory: checked by the reader, which says so
    kind: Kind
    module: Name = ""
    forward: Optional[Index] = None
    bytes: Optional[Count] = None
    tensors: Annotated[dict[Role, ManifestTensor], Meta(max_length=MAX_ROLES)] = {}
    grads: Optional[ManifestGrads] = None
    # a decode step stored by its new rows: the index of the earlier call of the module whose K and V it extends
    kv_base: Optional[Index] = None
    # a step of a full sliding window: the rows of the base's K and V (columns of its mask) dropped from the front
    kv_drop: Optional[Count] = None
    rope: Optional[Index] = None  # the rotary table (``rope_tables``) the call ran under, where recorded


class ManifestRope(Struct):
    """A rotary table the calls ran under (``position_embeddings``), written once per distinct table."""

    index: Index
    file: Name  # rope-NNNN.safetensors: checked by the reader
    shape: Annotated[list[Dim], Meta(max_length=MAX_AXES)] = []
    dtype: Optional[Short] = None
    theta: Optional[Annotated[float, Meta(gt=0)]] = None  # from the model's config
    rope_type: Optional[Short] = None  # one of params.ROPE_TYPES: checked by the reader, which names the table
    positions: bool = False  # position_ids recorded beside cos and sin
    # the config's rope parameters the type's frequencies are computed from (factor, original_max_position_embeddings)
    parameters: Annotated[
        dict[Short, Union[float, bool, Annotated[list[float], Meta(max_length=4096)]]], Meta(max_length=64)
    ] = {}  # longrope's long_factor and short_factor: a number per frequency


class ScriptFacts(Struct):
    path: Optional[Name] = None
    argv: Annotated[list[Name], Meta(max_length=10_000)] = []
    error: Optional[Message] = None


class CompileFacts(Struct):
    mode: Optional[Literal["eager", "keep"]] = None
    compiled_runs: Optional[Count] = None
    compiled_calls: Optional[Count] = None


class Unrecorded(Struct):
    """The first call (or a call's gradients) a capture did not record once recording stopped."""

    index: Index
    kind: Optional[Short] = None
    module: Name = ""
    what: Literal["call", "gradients"] = "call"


class Manifest(Struct):
    schema: Schema
    calls: Annotated[list[ManifestCall], Meta(max_length=MAX_CALLS)]
    attncheck_version: Optional[Short] = None
    torch_version: Optional[Short] = None
    created: Optional[Short] = None
    complete: Optional[bool] = None
    stopped: Optional[Message] = None
    error: Optional[Message] = None
    script: Optional[ScriptFacts] = None
    calls_seen: Optional[Count] = None
    calls_recorded: Optional[Count] = None
    max_calls: Optional[Count] = None
    max_bytes: Optional[Count] = None
    modules: Annotated[list[Name], Meta(max_length=10_000)] = []
    # the forward passes recorded: '1,3,5-9' (a list of numbers in captures before ranges were kept as ranges)
    forwards: Optional[Union[Annotated[list[Index], Meta(max_length=MAX_CALLS)], Message]] = None
    total_bytes: Optional[Count] = None
    grads: Optional[bool] = None  # gradients were recorded where a backward reached a call
    grad_calls: Optional[Count] = None
    compile: Optional[CompileFacts] = None
    first_unrecorded: Optional[Unrecorded] = None
    # Under torchrun (several processes): this capture's rank, the world size and the job's id (torchrun's run id)
    rank: Optional[Annotated[int, Meta(ge=0, le=1 << 20)]] = None
    world: Optional[Annotated[int, Meta(ge=1, le=1 << 20)]] = None
    run_id: Optional[Short] = None
    rope_tables: Annotated[list[ManifestRope], Meta(max_length=MAX_CALLS)] = []


class CallMeta(Struct):
    """A call file's metadata. safetensors keeps strings only: numbers and flags are read from
    them ('0.125', 'true'), and 'none' stands for a value not given (``NONE_FIELDS``)."""

    format: Schema
    kind: Kind
    call: Index
    module: Name = ""
    forward: Index = 0  # 0: outside any module
    dtype: Optional[ComputeDtype] = None
    softmax_dtype: Optional[ComputeDtype] = None
    autocast_dtype: Optional[ComputeDtype] = None
    is_causal: bool = False
    scale: Optional[Scale] = None
    scale_source: Optional[Short] = None
    enable_gqa: bool = False
    dropout_p: Probability = 0.0
    has_qk: bool = False
    num_heads: Optional[Annotated[int, Meta(ge=1, le=1 << 20)]] = None
    mha: bool = False
    q_prescaled: bool = False
    sdpa_backend: Optional[Short] = None
    compiled: Optional[Literal["eager"]] = None  # ran inside torch.compile'd code, recorded as its eager code
    flex_impl: Optional[Literal["compiled", "math"]] = (
        None  # a flex call: FlexAttention's fused kernel, or its math path
    )
    score_mod: Optional[Short] = None  # a flex call's score_mod and mask_mod, by name ('none': not given)
    mask_mod: Optional[Short] = None
    flex_q_block: Optional[Annotated[int, Meta(ge=1, le=1 << 40)]] = (
        None  # the BlockMask's block sizes (the fused kernel's tiles)
    )
    flex_kv_block: Optional[Annotated[int, Meta(ge=1, le=1 << 40)]] = None
    logit_before_mod: Optional[Annotated[float, Meta(ge=-1.7976931348623157e308, le=1.7976931348623157e308)]] = None
    mask_op: Optional[Literal["add", "fill", "none"]] = (
        None  # how the eager code applied its mask (the backward differs)
    )
    softcap: Optional[Short] = None  # a soft-capped softmax call's cap (cap * tanh(S * scale / cap)), or 'unknown
    device: Optional[Short] = None  # torch's name of the device the call ran on: 'cpu', 'cuda:0'
    # On CUDA: the GPU's compute capability and name; for an SDPA call, the flash implementation PyTorch had active
    # (torch.nn.attention's registry: 'fa2' by default, else the activated name lowercased: 'fa3', 'fa4')
    capability: Optional[Capability] = None
    gpu_name: Optional[Short] = None
    flash_impl: Optional[ImplName] = None
    # A flash_attn call: which function of which package, and the arguments SDPA has no counterpart for
    flash_fn: Optional[Literal["flash_attn_func", "flash_attn_varlen_func"]] = None
    flash_package: Optional[Literal["fa2", "fa3", "fa4"]] = None  # flash_attn, flash_attn_interface, flash_attn.cute
    window: Optional[Window] = None  # window_size as given ('-1,-1': none); causal and window are bottom-right aligned
    descales: Optional[Descales] = None  # FA3's q_descale, k_descale, v_descale (their tensors are in the file)
    module_sinks: Optional[Literal["ignored"]] = None  # an SDPA call whose module holds sinks it was not given
    sinks: bool = False  # learned sinks, one logit per query head (tensor 'sinks'): gpt-oss's eager softmax, FA4's
    flash_extras: Optional[Short] = None  # other arguments that change what it computes: 'alibi_slopes,qv', or 'none'
    varlen_seq: Optional[Index] = None  # flash_attn_varlen_func: recorded one call per sequence: which, of how many
    varlen_seqs: Optional[Annotated[int, Meta(ge=1, le=MAX_BYTES)]] = None
    dtypes: Optional[Message] = None
    shapes: Optional[Message] = None
    # k_tail, v_tail (and attn_mask_tail) extend this earlier call's k, v (and mask) of the module (record.kvdedup)
    kv_base: Optional[Index] = None
    kv_drop: Optional[Count] = None  # ... less its first kv_drop rows (a full sliding window)


NONE_FIELDS = ("dtype", "softmax_dtype", "autocast_dtype", "scale", "num_heads", "scale_source", "sdpa_backend")


# What a metadata field must hold, for the message that refuses it.
FIELD_HELP = {
    "kind": "sdpa, softmax, flex or flash_attn",
    "capability": "a CUDA compute capability such as 9.0",
    "flash_impl": "the name of a flash attention implementation (fa2, fa3, fa4)",
    "window": "a window size 'left,right' in keys (-1: unbounded)",
    "descales": "none, or which of q, k, v had a descale factor: 'q,k,v'",
    "flash_fn": "flash_attn_func or flash_attn_varlen_func",
    "flash_package": "fa2, fa3 or fa4",
    "dtype": "the dtype attncheck reads a call in: float16, bfloat16, float32 or float64",
    "softmax_dtype": "float16, bfloat16, float32, float64 or none",
    "autocast_dtype": "float16, bfloat16, float32, float64 or none",
    "scale": "a positive finite number, or none for SDPA's default 1/sqrt(d)",
    "dropout_p": "a probability from 0 to 1",
    "forward": "a forward pass number, 0 outside any module",
    "call": "the call's index",
    "num_heads": "a head count >= 1",
}


def meta_fields(meta: dict[str, str]) -> dict[str, str | None]:
    """The metadata with 'none' and '' read as not given where a field takes None."""
    return {k: (None if k in NONE_FIELDS and v in ("none", "") else v) for k, v in meta.items()}


__all__ = [
    "CAPTURE_SCHEMA_PREFIX",
    "FIELD_HELP",
    "CallMeta",
    "MAX_CALLS",
    "Manifest",
    "ManifestCall",
    "ManifestTensor",
    "ScriptFacts",
    "meta_fields",
]
