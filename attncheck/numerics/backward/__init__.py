"""The backward pass through attention: dQ, dK and dV as each kernel path computes them.

``paths`` holds the rounding points of each path's backward (eager autograd, PyTorch's math
SDPA, the FlashAttention-2 backward of PyTorch's CPU flash kernel) and the float64 reference;
``diagnose`` runs them over a call's heads in blocks and fills ``results.CellBackward``.
"""
