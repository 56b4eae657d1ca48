"""Attention paths, one module per implementation (``registry.PATHS`` registers them).

Each module holds everything about one implementation: its ``PATH`` spec (what it is, which
captured implementations it stands for, what it supports, its backward), its forward on a block
of rows, and its rounding points as the module docstring (``docs/reference/numerics.md`` is
generated from it). Modules import torch inside their functions only: the registry reads their
specs when the CLI starts, and ``attncheck --help`` must not import torch.
"""
