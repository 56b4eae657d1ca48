"""A kernel path is one unit: one module declares everything about it, one line registers it, and the
rest of attncheck asks the path (its spec) rather than comparing path names."""

import ast
import sys
import textwrap
from pathlib import Path

import torch

from attncheck.numerics.cells.plan import kernel_replays, model_path
from attncheck.registry import PATH_MODULES, PATHS
from attncheck.results import CallInfo

PACKAGE = Path(__file__).resolve().parents[3] / "attncheck"


def test_every_path_module_declares_its_path_and_is_registered_once():
    for name in PATH_MODULES:
        spec = __import__(f"attncheck.numerics.paths.{name}", fromlist=["PATH"]).PATH
        assert PATHS.get(spec.name) is spec
        assert spec.doc.strip(), f"{name}: its rounding points (the module docstring) are missing"
    assert len({s.name for s in PATHS}) == len(PATH_MODULES)


def _compared_path_names(path: Path) -> list[tuple[int, str]]:
    """String constants naming a path that take part in a comparison (==, !=, in) in a file."""
    names = {s.name for s in PATHS}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        for part in [node.left, *node.comparators]:
            items = part.elts if isinstance(part, (ast.Tuple, ast.List, ast.Set)) else [part]
            found += [(node.lineno, i.value) for i in items if isinstance(i, ast.Constant) and i.value in names]
    return found


def test_nothing_compares_path_names():
    """Outside the path modules and the registry, no code compares a path's name: it asks the spec
    (stands_for, scores, backward, runs_methods, device, replay). 'eager', 'math' and 'flex' are also the
    names of other things (a compile mode, a flex implementation, a backward, a kind of call), and 'fa2', 'fa3',
    'fa4' the flash-attn generations a capture records (``flash_impl``, ``flash_package``): those are allowed."""
    shared = {"eager", "math", "flex", "fa2", "fa3", "fa4"}
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[:2] == ("numerics", "paths") or rel.name == "registry.py":
            continue
        hits += [f"{rel}:{line} {name!r}" for line, name in _compared_path_names(path) if name not in shared]
    assert hits == []


NEW_PATH = '''
"""**toy**: attention in fp32 whatever the dtype, for the test of a new path."""

from __future__ import annotations

from attncheck.numerics.paths.base import PathSpec, Stands

PATH = PathSpec("toy", "fp32 attention", f"{__name__}:forward", default=False, device="cuda", replay=True,
                backward="recompute", stands_for=(Stands("sdpa", "toy_attention", "cuda"),))


def forward(block, dt, methods, params):
    from attncheck.numerics.paths import sdpa_math

    pb = sdpa_math.forward(block, dt, methods, params)
    pb.cells = [(PATH.name, pb.cells[0][1])]
    return pb
'''


def test_a_new_path_is_one_file_and_one_registration(tmp_path, monkeypatch):
    """A path written in one module and registered with one call: the capture's calls of the kernel it
    stands for are judged by it, --what-if kernels replays it, Q/K files compute it with --path."""
    (tmp_path / "toy_path.py").write_text(textwrap.dedent(NEW_PATH))
    monkeypatch.syspath_prepend(str(tmp_path))
    PATHS.register(__import__("toy_path").PATH)
    try:
        meta = {"device": "cuda:0", "sdpa_backend": "toy_attention", "shapes": '{"q": [1, 1, 4, 8], "k": [1, 1, 4, 8]}'}
        info = CallInfo(index=0, name="c", kind="sdpa", dtype="fp16", meta=meta)
        assert model_path(info) == "toy"
        assert "toy" in kernel_replays(replace_backend(info, "flash_attention"), "fp16")
        from attncheck.config.run import Options
        from attncheck.judge import diagnose_attention
        from attncheck.numerics.inputs.scores import prepare_inputs

        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 1, 4, 8) for _ in range(3))
        diag = diagnose_attention("toy", prepare_inputs(q, k, v=v), Options(dtypes=("fp16",), paths=("toy",)))
        assert [c.name for c in diag.cells] == ["toy/fp16"] and diag.cells[0].nan_rows == 0
    finally:
        PATHS.unregister("toy")
        sys.modules.pop("toy_path", None)


def replace_backend(info: CallInfo, backend: str) -> CallInfo:
    from dataclasses import replace

    return replace(info, meta={**info.meta, "sdpa_backend": backend})
