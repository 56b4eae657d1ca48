"""Tensors -> results. No printing, no paths, no typer or rich.

Grouped by what a reader looks for:

``precision``   the dtype registry's torch side: torch dtypes and thresholds from torch.finfo
``rowmath``, ``reduce``  row formulas (entropy, KL, Jacobian), exact cross-chunk sums, row bookkeeping
``inputs``      what goes in: Q, K and a mask -> scores per dtype as models compute them, the
                mask/scale audit (``inputs.scores``); per-head facts of a call (``inputs.heads``)
``methods``     how each implementation computes: the softmax methods and the float64 reference
                (``methods.softmax``, ``methods.online``), the attention paths (``methods.paths``),
                FP8 (``methods.fp8``, ``methods.fp8_attention``)
``cells``       what is asked: the cells of a diagnosis and their accumulators (``cells.plan``,
                ``cells.accumulate``), one tensor -> a TensorDiagnosis (``cells.diagnose``), one
                attention call -> its report (``cells.calls``), the CI check's budgets (``cells.budgets``)
``backends``    the per-row facts of a chunk: torch ops, or fused numba kernels on the CPU
``sweep``       synthetic grids: the generator, the measurements, the theory, published figures
"""
