"""Tensors -> results. No printing, no paths, no typer or rich.

``precision``   the dtype registry's torch side: torch dtypes and thresholds from torch.finfo
``softmax``     the registered methods (naive, stable, tiled, torch) and the float64 reference
``scores``      Q, K and a mask -> scores per dtype as models compute them; the mask/scale audit
``diagnose``    one tensor -> a TensorDiagnosis, in row chunks
``backends``    the per-row facts of a chunk: torch ops, or fused numba kernels on the CPU
``accumulate``  row facts -> census, distribution and cells, independent of the chunking
``rowmath``, ``reduce``  row formulas (entropy, KL, Jacobian) and exact cross-chunk sums
``synthetic``, ``sweep``, ``theory``  the sweep's generator, measurements and theory
``budgets``     the CI check's budgets over diagnoses
"""
