"""Recording attention calls while a model runs, without editing it.

A ``torch.overrides.TorchFunctionMode`` sees every call of a torch function that dispatches
``__torch_function__``. The recorder takes:

- every ``F.scaled_dot_product_attention``: q, k, v, attn_mask, is_causal, scale, enable_gqa,
  dropout_p, as the caller passed them;
- every softmax (``torch.softmax``, ``F.softmax``, ``Tensor.softmax``) over the last axis of a
  tensor with 3 or more axes inside a module: its input is the eager path's masked scores.
  Inside the same module, the last matmul of two 3+-D tensors whose result the softmax input
  derives from (through multiplications by numbers, which give the scale, and additions,
  fills, casts) gave the scores: its operands are q and k^T. The first matmul that consumes
  the softmax output gives v.

The calling module's path comes from global forward pre- and post-hooks: the deepest module
running, named as the top module's ``named_modules()`` names it (the top module itself by its
class name).

``nn.MultiheadAttention`` (and ``TransformerEncoderLayer``) run ``F.multi_head_attention_forward``,
which handles ``__torch_function__`` itself, so the calls inside it are not dispatched to the
mode: while it runs, the recorder routes ``F.scaled_dot_product_attention``, ``F.softmax``,
``torch.bmm`` and ``torch.baddbmm`` through itself (module attributes, restored when it
returns). While recording, PyTorch's fused MHA fast path is off (a torch function mode turns
it off by itself): results are bit-identical to the same model run with
``torch.backends.mha.set_fastpath_enabled(False)``.

The flash-attn package (``flash_attn_func``, ``flash_attn_varlen_func`` of FlashAttention-2, -3 and -4, where
installed; ``flash=True``): its functions are patched while recording (``attncheck.record.flash``), each call
recorded as kind 'flash_attn' with q, k, v in attncheck's (B, H, T, D) layout; torch calls inside one (a fallback
through SDPA) are not recorded again. Their gradients are not recorded.

On CUDA every call also says the GPU's compute capability and name, and an SDPA call the flash implementation
PyTorch had active (``flash.gpu_facts``).

FlexAttention (``torch.nn.attention.flex_attention``): its operator (``flex_attention_hop``) is
dispatched to the mode with the scale, GQA and block mask resolved. The recorder takes q, k, v,
the block mask's ``mask_mod`` evaluated as a boolean mask (True: attend) and, where a ``score_mod``
is given, the logits after it as flex's math path computes them (``_math_attention_inner``: fp32
from q and k upcast, in ``scores_mod``) and in float64 (from float64 q and k, in ``scores_mod64``,
the reference); ``flex_impl`` says which of flex's implementations the program runs: 'compiled'
inside torch.compile'd code (the fused kernel), else 'math' (flex without torch.compile).

The wrapped functions are called with exactly the arguments they were given and their results
returned unchanged; recording reads tensors and never writes to them.

Gradients (``grads=True``): when a recorded call's output requires grad, autograd hooks that only
read record, once the backward reaches the call, its output gradient dO (``grad_out``) and the
gradients its kernel produced for q, k and v (``grad_q``, ``grad_k``, ``grad_v``): for a fused SDPA
kernel from the kernel's own autograd node, otherwise from the tensors the call was given (the
eager path: the operands of its Q@K^T and P@V matmuls). An SDPA call also keeps its output O
(``out``), which the flash backward reads. A backward that runs after the ``with`` block is not
recorded (the hooks are removed on exit).

Threads: a torch function mode is per thread. A thread started while recording runs with the mode
on its own stack (``Thread.start`` wraps its ``run``), so its calls are recorded like the main
thread's; ``F.scaled_dot_product_attention`` is routed through the recorder while it records, so SDPA
calls from threads that were running before recording began are recorded too. Only the eager
softmax calls of such older threads are not seen. Call numbers, bounds and the sink are taken under
one lock; what is traced around a softmax (and the module path) is kept per thread.
"""

from __future__ import annotations

import sys
import threading
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack, _pop_mode, _push_mode

from attncheck.errors import AttncheckError
from attncheck.record.bounds import BoundsMixin
from attncheck.record.compiled import CompileMixin, compiling
from attncheck.record.eager import EagerMixin
from attncheck.record.flash import FlashPatch
from attncheck.record.flashattn import FlashMixin
from attncheck.record.flex import FlexMixin, flex_hop
from attncheck.record.grads import GradsMixin
from attncheck.record.kvdedup import KvDedup
from attncheck.record.mha import MhaMixin
from attncheck.record.modules import ModuleStack
from attncheck.record.ops import MATMULS, MHA_FORWARD, SDPA, Recorded, Sink
from attncheck.record.rope import RopeWatch
from attncheck.record.sdpa import SdpaMixin
from attncheck.record.state import GradWatch, Pending, ThreadState
from attncheck.record.threads import ThreadsMixin


class Recorder(
    ThreadsMixin,
    CompileMixin,
    BoundsMixin,
    GradsMixin,
    SdpaMixin,
    FlashMixin,
    FlexMixin,
    EagerMixin,
    MhaMixin,
    TorchFunctionMode,
):
    """The mode: hands each call to ``sink`` (a callable taking a ``Recorded``) within bounds.

    ``modules``: globs a call's module path must match (a call outside any module is named
    'global'); ``forwards``: which forward passes of the top module to record (1-based; None:
    all, and calls outside any module too); ``max_calls``, ``max_bytes``: when the next call
    would pass either, recording stops for good and ``stopped`` says why. ``in_modules``: the mode
    is on only while a top module's forward runs, in the thread that runs it (calls outside every
    module are not recorded; the rest of a training loop, its optimizer step, pays nothing).
    ``compile``: what torch.compile'd code does while recording. 'eager': the compiler's stance is
    ``force_eager``, so compiled modules and functions run their Python code, whose calls are
    recorded with ``compiled = 'eager'`` in their metadata (the eager code is judged, not inductor's
    kernels); 'keep': compiled code runs compiled and its calls are not recorded (the hooks and the
    mode stay out of the graphs dynamo traces); ``compiled_runs`` counts the compiled modules and
    functions that ran. None (the watch): as 'keep'. ``flash``: the flash-attn package's functions are
    recorded (patched while recording, where the package is installed). ``dedup_kv``: a call whose K and V extend
    those of its module's previous call (a decode step) is handed over with only the new rows (``record.kvdedup``;
    for a sink that writes, never for one that diagnoses or keeps whole calls).
    """

    def __init__(
        self,
        sink: Sink | Callable[[Recorded], None],
        *,
        modules=(),
        forwards=None,
        max_calls: int | None = None,
        max_bytes: int | None = None,
        notice: Callable[[str], None] | None = None,
        grads: bool = True,
        outputs: bool = False,
        in_modules: bool = False,
        compile: str | None = None,
        flex_reference: bool = True,
        flash: bool = False,
        dedup_kv: bool = False,
    ) -> None:
        super().__init__()
        # decode steps that extend their module's previous call are stored by their new rows (record.kvdedup)
        self.dedup = KvDedup() if dedup_kv else None
        self.in_modules = in_modules
        self.flex_reference = flex_reference  # a flex call's float64 logits after its score_mod (the watch needs none)
        if compile not in (None, "eager", "keep"):
            raise AttncheckError(f"must be 'eager' or 'keep', got {compile!r}", param="compile")
        self.compile = compile
        self.compiled_calls = 0  # calls recorded inside compiled code run eagerly
        self._stance = None
        self._warnings = None
        self._compile_before = None
        self.sink = sink
        self.grads = grads
        self.outputs = outputs  # an SDPA call keeps its output even without a backward (the watch reads it)
        self._watches: list[GradWatch] = []
        self.grad_calls = 0  # calls whose gradients were recorded
        self.modules = tuple(modules)
        self.forwards = forwards  # anything with ``in`` (record.Forwards: ranges, never expanded)
        self.max_calls, self.max_bytes = max_calls, max_bytes
        self.notice = notice
        self.tracker = ModuleStack(self._top if in_modules else None)
        self.rope = RopeWatch()  # the rotary tables the calls ran under, for a sink that keeps them
        if hasattr(sink, "rope"):
            self.tracker.on_root = self.rope.attach
        self.recorded = 0
        self.bytes = 0
        self.seen = 0  # calls that matched the filters, recorded or not
        self.outside_forwards = 0  # calls left out by ``forwards`` alone
        self.stopped: str | None = None
        self.first_missed: dict | None = None  # the first call (or gradients) not recorded once recording stopped
        # Calls come from every thread: numbering, bounds and the sink are taken one call at a time;
        # what is traced around a softmax is kept per thread (ThreadState).
        self._lock = threading.RLock()
        self._local = threading.local()
        self._threads: list[ThreadState] = []
        self._mha_lock = threading.Lock()  # nn.MultiheadAttention routes module attributes: one at a time
        self._fastpath: bool | None = None
        self._closed = False
        self._start_before = None
        self._start_wrapper = None
        self._sdpa_before = None
        self._sdpa_wrapper = None
        self._flash_patch = FlashPatch(self._flash_call) if flash else None
        self.flash_unrecorded = 0  # flash-attn calls whose arguments cannot be recorded (a paged KV cache)

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self):
        self._fastpath = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        self.tracker.__enter__()
        # Other threads: a thread started while recording runs its target with the mode on its own
        # stack (Thread.start wraps the thread's run); an SDPA call from a thread running already comes
        # through the module attribute, which records it.
        self._start_before = threading.Thread.start
        if not self.in_modules:  # in_modules: a forward's own thread puts the mode on
            threading.Thread.start = self._start_wrapper = self._thread_start(self._start_before)
        self._sdpa_before = F.scaled_dot_product_attention
        self._sdpa_wrapper = self._sdpa_any_thread  # one bound method, to tell it apart when restoring
        F.scaled_dot_product_attention = self._sdpa_wrapper
        if self._flash_patch is not None:
            self._flash_patch.__enter__()
        # torch warns that global hooks fire once more for torch.compile(module)'s wrapper: the module stack knows
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
        if self.compile is not None:
            self._compile_before = torch.compile
            torch.compile = self._compile_wrapper(self._compile_before)
            if self.compile == "eager" and "torch._dynamo" in sys.modules:
                self._force_eager()  # else at the first torch.compile (loading the compiler makes a folder in /tmp)
        if self.in_modules:
            return self
        self._thread().mode = True
        return super().__enter__()

    def _top(self, begins: bool) -> None:
        """``in_modules``: a top module's forward begins (the mode goes on this thread's stack) or ends
        (it comes off, where it is still on top: a mode the forward left on the stack stays)."""
        if self._closed:
            return
        state = self._thread()
        if begins and not state.mode:
            state.mode = True
            _push_mode(self)
        elif not begins and state.mode:
            state.mode = False
            stack = _get_current_function_mode_stack()
            if stack and stack[-1] is self:
                _pop_mode()

    def __exit__(self, *exc):
        try:
            if not self.in_modules:
                return super().__exit__(*exc)
            if self._thread().mode:  # left inside a forward
                self._top(False)
        finally:
            self._thread().mode = False
            self._closed = True
            if threading.Thread.start is self._start_wrapper:
                threading.Thread.start = self._start_before
            if F.scaled_dot_product_attention is self._sdpa_wrapper:
                F.scaled_dot_product_attention = self._sdpa_before
            if self._flash_patch is not None:
                self._flash_patch.__exit__(*exc)
            if self._compile_before is not None:
                torch.compile = self._compile_before
            if self._stance is not None:
                self._stance.__exit__(None, None, None)  # the stance the program had
            if self._warnings is not None:
                self._warnings.__exit__(None, None, None)
            self.tracker.__exit__(*exc)
            self.rope.detach()
            torch.backends.mha.set_fastpath_enabled(bool(self._fastpath))
            with self._lock:
                for state in list(self._threads):  # softmax calls still waiting for their v, in every thread
                    if state.pending is not None:
                        pending, state.pending = state.pending, None
                        self._hand_over(pending)
                for w in self._watches:  # a backward after the block is not recorded
                    w.remove()
                self._watches = []

    def flush(self) -> None:
        """Hand over a softmax call (of this thread) still waiting for its v."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._hand_over(pending)

    def _hand_over(self, pending: Pending) -> None:
        pending.call.expects_grads = bool(pending.grads)
        if self._emit(pending.call) and pending.grads:
            self._watch(
                pending.call,
                pending.grads["grad_out"],
                None,
                {r: t for r, t in pending.grads.items() if r != "grad_out"},
            )

    # ------------------------------------------------------------------ dispatch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            self._closed or compiling()
        ):  # a thread that outlived the capture keeps the mode on its stack; dynamo tracing
            return func(*args, **kwargs)
        if self._thread().in_flash:  # inside a flash-attn call being recorded: its own ops are not calls of their own
            return func(*args, **kwargs)
        if func is SDPA:
            return self._sdpa(func, args, kwargs)
        name = getattr(func, "__name__", None)
        if name == "softmax":
            return self._softmax(func, args, kwargs)
        if func is MHA_FORWARD:
            return self._mha(func, args, kwargs)
        if name == "flex_attention" and func is flex_hop():
            return self._flex(func, args, kwargs)
        out = func(*args, **kwargs)
        if self.stopped is None and name is not None and self.tracker.stack:
            state = self._thread()
            if name in MATMULS or state.pending is not None or state.scores:  # most ops: nothing to follow
                self._trace(name, args, kwargs, out)
        return out
