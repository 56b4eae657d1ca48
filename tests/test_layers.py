"""The layers stay apart: which modules import torch, and which layer may import which.

loaders (files -> tensors), numerics (tensors -> numbers), judge (numbers -> findings), report
(results -> tables, JSON), cli (commands), pipelines (each command as a library call); registry,
params, options, results, findings and config are free of torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "attncheck"

TORCH_FREE = [
    "attncheck",
    "attncheck.errors",
    "attncheck.format",
    "attncheck.registry",
    "attncheck.params",
    "attncheck.results",
    "attncheck.results.common",
    "attncheck.results.backward",
    "attncheck.results.run",
    "attncheck.results.model",
    "attncheck.results.sweep",
    "attncheck.results.check",
    "attncheck.results.watch",
    "attncheck.results.lowsum",
    "attncheck.results.rope",
    "attncheck.config.rope",
    "attncheck.report.rope",
    "attncheck.cli.rope",
    "attncheck.pipelines.rope",
    "attncheck.codes",
    "attncheck.findings",
    "attncheck.findings.base",
    "attncheck.findings.registry",
    "attncheck.findings.diagnosis",
    "attncheck.findings.policy",
    "attncheck.findings.inputs",
    "attncheck.findings.masking",
    "attncheck.findings.lowsum",
    "attncheck.findings.scale",
    "attncheck.findings.overflow",
    "attncheck.findings.hazards",
    "attncheck.findings.accuracy",
    "attncheck.findings.fp8",
    "attncheck.findings.distribution",
    "attncheck.findings.backward",
    "attncheck.findings.capture",
    "attncheck.findings.rope",
    "attncheck.findings.watch",
    "attncheck.model",
    "attncheck.config.run",
    "attncheck.config.sweep",
    "attncheck.config.check",
    "attncheck.config.values",
    "attncheck.config.budgets",
    "attncheck.config.synthetic",
    "attncheck.config.inputs",
    "attncheck.config.capture",
    "attncheck.options",
    "attncheck.draws",
    "attncheck.testing",
    "attncheck.report.run",
    "attncheck.report.sweep",
    "attncheck.report.sweep_plot",
    "attncheck.report.check",
    "attncheck.report.progress",
    "attncheck.report.model",
    "attncheck.report.model_calls",
    "attncheck.report.model_heads",
    "attncheck.report.kernels",
    "attncheck.report.model_json",
    "attncheck.cli",
    "attncheck.cli.common",
    "attncheck.cli.options",
    "attncheck.cli.run",
    "attncheck.cli.run_checks",
    "attncheck.cli.run_options",
    "attncheck.cli.emit",
    "attncheck.cli.sweep",
    "attncheck.cli.check",
    "attncheck.cli.capture",
    "attncheck.cli.explain",
    "attncheck.report.reference",
    "attncheck.report.diagnostics",
    "attncheck.report.summary",
    "attncheck.report.fit",
    "attncheck.cli.docs",
    "attncheck.numerics",
    "attncheck.numerics.sweep.theory",
    "attncheck.pipelines",
    "attncheck.numerics.paths.base",
    "attncheck.numerics.paths.fa4_exp2",  # the fa4 path imports it at the top
    "attncheck.watcher",
    "attncheck.watcher.steps",
    "attncheck.watcher.recording",
    "attncheck.watcher.log",
]
# Each path module declares its spec beside its numerics and is read when the CLI starts: torch only inside functions
TORCH_FREE += [
    f"attncheck.numerics.paths.{name}"
    for name in __import__("attncheck.registry", fromlist=["PATH_MODULES"]).PATH_MODULES
]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_imports_no_torch(module):
    """Each in a fresh interpreter: importing it must not import torch (or numpy)."""
    code = f"import sys, {module}; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"], module


def imports_of(path: Path) -> set[str]:
    """Every attncheck module a file imports, at any depth (function-level imports too)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("attncheck"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("attncheck"))
    return found


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


# layer -> layers it must never import (a lazy import inside a function counts too)
FORBIDDEN = {
    "loaders": {"report", "cli", "pipelines", "config", "findings", "record"},
    "numerics": {"report", "cli", "pipelines", "record"},
    "report": {"loaders", "cli", "pipelines"},
    "config": {"numerics", "loaders", "report", "cli", "pipelines", "findings", "model", "record"},
    # results are plain data: they know nothing of config (config builds on them), codes or findings
    "results": {"numerics", "loaders", "report", "cli", "pipelines", "findings", "codes", "config", "model", "record"},
    # codes re-exports the registry, whose entries live beside their detectors in findings/<group>.py
    "codes": {"numerics", "loaders", "report", "cli", "pipelines", "config", "model", "record"},
    # ... so findings never import codes (importing codes first would find it half initialised)
    "findings": {"numerics", "loaders", "report", "cli", "pipelines", "codes"},
    "model": {"numerics", "loaders", "report", "cli", "pipelines", "record"},
    "record": {"report", "cli", "pipelines"},
    "registry": {"numerics", "loaders", "report", "cli", "pipelines", "config", "results", "findings", "params"},
    "params": {"numerics", "loaders", "report", "cli", "pipelines", "config", "results", "findings"},
    "pipelines": {"cli", "report"},
    # judgement: numbers (numerics' results) -> findings; the pipelines and the recorder's sinks call it
    "judge": {"loaders", "report", "cli", "pipelines", "record", "config"},
    # below loaders, numerics and config alike: what a diagnosis is asked (options), the dtypes' names (dtypes),
    # the device (devices), row-block sources (sources), the synthetic draws' sizes (draws)
    **{
        low: {"numerics", "loaders", "report", "cli", "pipelines", "config", "findings", "model", "record", "judge"}
        for low in ("options", "dtypes", "devices", "sources", "draws")
    },
}


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_layers_import_only_downwards(path):
    module = "attncheck." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
    layer = layer_of(module)
    bad = FORBIDDEN.get(layer, set())
    wrong = sorted(m for m in imports_of(path) if layer_of(m) in bad)
    if layer == "report":  # the sweep report shows the theory beside the measurements (pure math, no torch)
        wrong = [m for m in wrong if not m.startswith("attncheck.numerics.sweep.theory")]
    if layer == "registry":  # the paths' specs (torch-free types), declared in their numerics modules
        wrong = [m for m in wrong if not m.startswith("attncheck.numerics.paths.base")]
    assert not wrong, f"{module} ({layer}) imports {wrong}"


def test_numerics_never_print_or_read_paths():
    for path in (PACKAGE / "numerics").rglob("*.py"):
        text = path.read_text()
        assert "print(" not in text and "import typer" not in text and "from rich" not in text, path


def test_help_and_argument_errors_import_no_torch():
    code = (
        "import sys\nfrom typer.testing import CliRunner\nfrom attncheck.cli import app\n"
        "r = CliRunner().invoke(app, ['run', '--dtype', 'fp8', 'x.npy'])\n"
        "h = CliRunner().invoke(app, ['sweep', '--help'])\n"
        "c = CliRunner().invoke(app, ['capture', '--help'])\n"
        "e = CliRunner().invoke(app, ['capture', '--ignore', 'no_such_code', 'x.py'])\n"
        "print(r.exit_code, h.exit_code, c.exit_code, e.exit_code, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["2", "0", "0", "2", "False"]


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _runtime_imports(path: Path, modules: set[str]) -> set[str]:
    """The attncheck modules a file imports when it runs (function-level imports and importlib.import_module of
    a literal name too; imports under ``if TYPE_CHECKING:`` do not run and are left out). ``from P import x``
    is an edge to the submodule P.x where there is one, else to P."""
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    me = _module_name(path)
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("attncheck"):
            for a in node.names:
                found.add(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("attncheck"))
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func).endswith("import_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith("attncheck")
        ):
            found.add(node.args[0].value)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):  # KERNELS_MODULE = "attncheck..."
            if isinstance(node.value.value, str) and node.value.value in modules:
                found.add(node.value.value)
    return {m for m in found if m in modules and m != me}


def test_no_import_cycles():
    """No two modules import each other, directly or round a loop: a cycle hides the order of the layers and
    breaks on the first import that runs at the top of a module (the graph found by a walk of the source)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: _runtime_imports(p, set(files)) for m, p in files.items()}
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert cycles == [], cycles


# Numerics returns numbers: what they mean (findings, model, codes, judge) is judged above it, and what it is
# asked (config) reaches it as arguments (an ``Options``, defined below it in ``attncheck.options``); loaders and
# numerics share only modules below both (dtypes, sources, devices). Counted as the imports run: those inside
# functions too, those under ``if TYPE_CHECKING:`` (a type of an argument) not.
RUNTIME_FORBIDDEN = {
    "numerics": {"findings", "model", "codes", "judge", "config", "loaders"},
    "loaders": {"numerics", "judge"},
}


@pytest.mark.parametrize(
    "path",
    sorted(p for layer in RUNTIME_FORBIDDEN for p in (PACKAGE / layer).rglob("*.py")),
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_numerics_return_numbers_and_loaders_stay_apart(path):
    files = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    module = _module_name(path)
    bad = RUNTIME_FORBIDDEN[layer_of(module)]
    wrong = sorted(m for m in _runtime_imports(path, files) if layer_of(m) in bad)
    assert not wrong, f"{module} ({layer_of(module)}) imports {wrong} when it runs"


def _local_import_blocks(tree: ast.Module):
    """Runs of consecutive import statements inside functions (blank lines between them allowed)."""
    bodies = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            for field in ("body", "orelse", "finalbody"):
                body = getattr(child, field, None)
                if inside and isinstance(body, list):
                    bodies.append(body)
            visit(child, inside)

    visit(tree, False)
    for body in bodies:
        block: list[ast.stmt] = []
        for stmt in [*body, None]:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                block.append(stmt)
            elif block:
                yield block
                block = []


def test_function_local_imports_say_why():
    """An import inside a function is there only to keep torch (or another heavy or optional import: numba,
    matplotlib, transformers, a slow report module) off a cheap path such as --help, and says so: a comment on the
    line above its run of imports, or on its own line. Any other import belongs at the top of the module."""
    bare = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        for block in _local_import_blocks(ast.parse("\n".join(lines))):
            above = lines[block[0].lineno - 2].strip()
            for node in block:
                own = any("#" in line for line in lines[node.lineno - 1 : node.end_lineno])
                if not (own or above.startswith("#")):
                    bare.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert bare == [], "\n".join(bare)


def test_no_function_imports_what_its_module_has_at_the_top():
    """A function-local import of a module the file already imports at its top keeps nothing off any path."""
    twice = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        top = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
        for block in _local_import_blocks(tree):
            twice += [
                f"{path.relative_to(PACKAGE.parent)}:{n.lineno}: {a.name}"
                for n in block
                if isinstance(n, ast.Import)
                for a in n.names
                if a.name in top
            ]
    assert twice == [], twice
