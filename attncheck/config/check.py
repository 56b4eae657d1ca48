"""What ``attncheck check`` is asked to verify: the ``[tool.attncheck]`` table, found and checked.

Free of torch and numpy, so a bad config fails in milliseconds, before the
heavy imports. The config is looked up as pytest and ruff do: from the current
directory upwards, the first ``attncheck.toml`` or ``pyproject.toml`` with a
``[tool.attncheck]`` table wins; ``--config FILE`` names one directly.
Input globs are resolved here, relative to the config file's folder, so a glob
that matches nothing is an input error before any tensor is read.

Every problem is an :class:`AttncheckError` whose one line names the key as it
is spelled in the file (``tool.attncheck.budget.nan``), and for TOML syntax
errors the line and column tomllib reports.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attncheck import params
from attncheck.config.sweep import DEFAULT_MAX_WORK, DIST_NAMES, head_layout, max_work, qk_bytes, work_text
from attncheck.errors import AttncheckError
from attncheck.format import size_text
from attncheck.params import ORDERS, Scale, show
from attncheck.registry import DTYPES, PATHS, cell_dtype, dtype_names, eager_path
from attncheck.results import BUDGET_NAMES, COUNT_BUDGETS, LOWER_BUDGETS, RELATIVE_BUDGETS, Budget

if TYPE_CHECKING:
    from attncheck.config.run import Options

try:  # Python >= 3.11
    import tomllib as _toml
except ImportError:  # pragma: no cover - Python 3.10
    try:
        import tomli as _toml  # type: ignore[no-redef]
    except ImportError:
        _toml = None

PYPROJECT = "pyproject.toml"
STANDALONE = "attncheck.toml"
TABLE = "tool.attncheck"
DEFAULT_METHODS = ("stable", "tiled", "torch")  # what real code runs; add "naive" to guard a hand-written softmax
DEFAULT_DEVICE = "cpu"  # reproducible across CI runners; "auto" or "cuda" to compute on the GPU
DEFAULT_SYNTHETIC_SEQ = 256
DEFAULT_SYNTHETIC_ROWS = 1024


@dataclass(frozen=True)
class SyntheticInput:
    """One ``[[tool.attncheck.synthetic]]`` entry: scores = scale * q.k from the sweep generator."""

    index: int
    d_k: int
    scale: Scale = Scale("sqrt")
    seq: int = DEFAULT_SYNTHETIC_SEQ
    rows: int = DEFAULT_SYNTHETIC_ROWS
    dist: str = "normal"
    std: float = 1.0
    seed: int = 0
    dtypes: tuple[str, ...] | None = None  # None: the config's dtypes
    paths: tuple[str, ...] = ()  # attention paths: Q, K and V are drawn and every path computes P and O = P@V

    @property
    def name(self) -> str:
        """'synthetic[0]:dk=128,scale=sqrt,seq=256,dist=normal,seed=0' (rows, std and paths when not default)."""
        extra = f",rows={self.rows}" if self.rows != DEFAULT_SYNTHETIC_ROWS else ""
        extra += f",std={self.std:g}" if self.std != 1.0 else ""
        extra += f",paths={'+'.join(self.paths)}" if self.paths else ""
        return (
            f"synthetic[{self.index}]:dk={self.d_k},scale={self.scale.name},seq={self.seq}{extra},"
            f"dist={self.dist},seed={self.seed}"
        )


@dataclass(frozen=True)
class CheckConfig:
    """A checked ``[tool.attncheck]`` table with its input globs resolved to files."""

    display: str = "<config>"  # how messages name the file: relative to the current directory when below it
    path: str | None = None  # absolute path of the file
    root: str = "."  # folder the input globs are relative to
    prefix: str = TABLE  # dotted key of the table in its file: 'tool.attncheck', or '' for attncheck.toml
    inputs: tuple[str, ...] = ()  # globs as written
    files: tuple[str, ...] = ()  # what they matched: absolute paths, sorted, no duplicates
    keys: tuple[str, ...] = ()  # globs picking tensors inside files; empty: all
    synthetic: tuple[SyntheticInput, ...] = ()
    dtypes: tuple[str, ...] = dtype_names()
    methods: tuple[str, ...] = DEFAULT_METHODS
    block: int = params.DEFAULT_BLOCK
    order: str = "forward"
    accum: str = "fp32"
    device: str = DEFAULT_DEVICE
    budget: Budget = field(default_factory=Budget)
    dtype_budgets: dict[str, Budget] = field(default_factory=dict)  # [tool.attncheck.budget.<dtype>] overrides
    max_memory: int | None = (
        None  # bytes, as max_memory = "1GiB": working memory of the diagnosis; None: the default chunks
    )
    max_work: int = DEFAULT_MAX_WORK  # score elements the synthetic inputs may compute together (as sweep --max-work)

    @property
    def memory_budget(self) -> int:
        """The most an input may hold whole (a .pt file, a Fortran-ordered array, a synthetic
        input's q and k): max_memory, or run's default of 1 GiB."""
        return self.max_memory if self.max_memory is not None else params.size(params.DEFAULT_MAX_MEMORY, "max_memory")

    ignore: tuple[str, ...] = ()  # finding codes judged expected: their rows do not count against the budgets

    def budget_for(self, dtype: str) -> Budget:
        return self.dtype_budgets.get(dtype, self.budget)

    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def name_of(self, parameter: str) -> str:
        """A library parameter as this file spells it: 'keys' -> 'tool.attncheck.keys'."""
        return self.key(CONFIG_KEYS[parameter]) if parameter in CONFIG_KEYS else parameter

    def options(self, dtypes: tuple[str, ...] | None = None, device: str | None = None) -> "Options":
        """The diagnosis options this config asks for (per synthetic entry: its dtypes)."""
        from attncheck.config.run import Options, chunk_elements_for

        chunks = {} if self.max_memory is None else {"chunk_elements": chunk_elements_for(self.max_memory)}
        return Options(
            dtypes=dtypes or self.dtypes,
            methods=self.methods,
            block=self.block,
            reverse=self.order == "reverse",
            accum=self.accum,
            device=device or self.device,
            **chunks,
        )


# Library parameters -> their key in [tool.attncheck]: errors raised below the config
# layer name parameters, and are shown in the file's terms (see errors.AttncheckError).
CONFIG_KEYS = {
    "keys": "keys",
    "dtypes": "dtypes",
    "methods": "methods",
    "block": "block",
    "reverse": "order",
    "accum": "accum",
    "device": "device",
    "max_memory": "max_memory",
    "chunk_elements": "max_memory",
}


# --------------------------------------------------------------------------- values


# TOML values are typed: a string where a number belongs is an error, not parsed.
def _count(value: Any, key: str) -> int:
    return params.integer(value, key, 0, from_text=False)


def _int(value: Any, key: str, minimum: int) -> int:
    return params.integer(value, key, minimum, from_text=False)


def _number(value: Any, key: str, *, positive: bool = False) -> float:
    return params.number(value, key, positive=positive, from_text=False)


def _string(value: Any, key: str, what: str = "a string") -> str:
    if not isinstance(value, str):
        raise AttncheckError(f"{key} must be {what}, got {show(value)}")
    return value


def _strings(value: Any, key: str, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AttncheckError(f"{key} must be a list of strings ({what}), got {show(value)}")
    return tuple(value)


def _choice(value: Any, key: str, allowed: tuple[str, ...]) -> str:
    return params.choice(value, allowed, key)


def _scale(value: Any, key: str) -> Scale:
    return params.scale(value, key)


def _size(value: Any, key: str) -> int:
    """'1GiB', '512MiB' or a number of bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return params.integer(value, key, 1, from_text=False)
    if not isinstance(value, str):
        raise AttncheckError(f'{key} must be a size such as "1GiB" or a number of bytes, got {show(value)}')
    return params.size(value, key)


# check judges whole softmaxes and the fp16/bf16/fp32 attention paths. An FP8 cell also depends on
# the P scale and on how Q, K and V are quantised, which `run` takes as options and a budget
# table has no key for: such a name is refused with the reason, not left to fail mid-run.
FP8_REFUSED = "FP8 cells need run's --p-scale and --fp8-scaling: judge them with 'attncheck run --dtype e4m3'"


def _dtypes(value: Any, key: str) -> tuple[str, ...]:
    """Dtypes a check computes in: fp16, bf16, fp32; an FP8 format is refused with the reason."""
    fp8 = [v for v in _listed(value) if v in DTYPES and DTYPES.get(v).p_format]
    if fp8:
        computed = ", ".join(dtype_names())
        raise AttncheckError(f"{key}: {fp8[0]!r} is an FP8 format; check computes in {computed} ({FP8_REFUSED})")
    return params.dtypes(value, key, fp8=False)


def _paths(value: Any, key: str) -> tuple[str, ...]:
    """Attention paths a check computes: every path but the FP8 ones (flash-fp8, sage)."""
    fp8 = [v for v in _listed(value) if v in PATHS and PATHS.get(v).fp8_only]
    if fp8:
        allowed = ", ".join(PATHS.names(lambda spec: not spec.fp8_only))
        raise AttncheckError(f"{key}: {fp8[0]!r} computes in FP8; check computes the paths {allowed} ({FP8_REFUSED})")
    return params.names(value, PATHS, key, lambda spec: not spec.fp8_only)


def _listed(value: Any) -> list[str]:
    """The names in a TOML value of one name or a list of them (anything else is params' to refuse)."""
    return [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)]


def _table(value: Any, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise AttncheckError(f"{key} must be a table, got {show(value)}")
    return value


def _reject_unknown(table: dict[str, Any], known: tuple[str, ...], prefix: str, display: str) -> None:
    for name in table:
        if name not in known:
            dotted = f"{prefix}.{name}" if prefix else name
            raise AttncheckError(f"unknown key '{dotted}' in {display} (known: {', '.join(known)})")


# --------------------------------------------------------------------------- tables

TOP_KEYS = (
    "inputs",
    "keys",
    "synthetic",
    "dtypes",
    "methods",
    "block",
    "order",
    "accum",
    "device",
    "max_memory",
    "max_work",
    "budget",
    "ignore",
)
SYNTHETIC_KEYS = ("d_k", "scale", "seq", "rows", "dist", "std", "seed", "dtype", "paths")
_AT = BUDGET_NAMES.index("relative_to_torch") + 1
BUDGET_KEYS = (*BUDGET_NAMES[:_AT], "relative_to_torch_atol", *BUDGET_NAMES[_AT:])


def parse_budget(table: dict[str, Any], prefix: str, display: str, base: Budget | None = None) -> Budget:
    """A budget table (no dtype subtables) -> Budget; keys missing keep ``base``'s values."""
    _reject_unknown(table, BUDGET_KEYS, prefix, display)
    values: dict[str, Any] = {}
    for name, value in table.items():
        key = f"{prefix}.{name}" if prefix else name
        if name in COUNT_BUDGETS:
            values[name] = _count(value, key)
        elif name in LOWER_BUDGETS:
            values[name] = params.cosine(value, key, from_text=False)
        else:
            values[name] = _number(value, key, positive=name in RELATIVE_BUDGETS)
    budget = replace(base or Budget(), **values)
    if "relative_to_torch_atol" in table and budget.relative_to_torch is None:
        key = f"{prefix}.relative_to_torch_atol" if prefix else "relative_to_torch_atol"
        raise AttncheckError(f"{key} is set but relative_to_torch is not")
    return budget


def _parse_budgets(value: Any, prefix: str, display: str) -> tuple[Budget, dict[str, Budget]]:
    """[budget] and its [budget.<dtype>] overrides."""
    table = _table(value, prefix)
    cells = dtype_names()  # a [budget.<dtype>] table for any dtype a check computes in
    for name in table:
        if name in DTYPES.names(cell_dtype) and name not in cells:
            raise AttncheckError(
                f"{prefix}.{name}: {name!r} is an FP8 format; check computes in {', '.join(cells)} ({FP8_REFUSED})"
            )
    own = {k: v for k, v in table.items() if k not in cells}
    _reject_unknown(own, BUDGET_KEYS + cells, prefix, display)
    base = parse_budget(own, prefix, display)
    per_dtype = {}
    for dtype in cells:
        if dtype in table:
            key = f"{prefix}.{dtype}"
            per_dtype[dtype] = parse_budget(_table(table[dtype], key), key, display, base)
    return base, per_dtype


def _parse_synthetic(value: Any, prefix: str, display: str) -> tuple[SyntheticInput, ...]:
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise AttncheckError(f"{prefix} must be an array of tables ([[{prefix}]]), got {show(value)}")
    out = []
    for i, entry in enumerate(value):
        at = f"{prefix}[{i}]"
        _reject_unknown(entry, SYNTHETIC_KEYS, at, display)
        if "d_k" not in entry:
            raise AttncheckError(f"{at}.d_k is missing (the head dimension, e.g. d_k = 128)")
        spec = SyntheticInput(index=i, d_k=_int(entry["d_k"], f"{at}.d_k", 1))
        changes: dict[str, Any] = {}
        if "scale" in entry:
            changes["scale"] = _scale(entry["scale"], f"{at}.scale")
        if "seq" in entry:
            changes["seq"] = _int(entry["seq"], f"{at}.seq", 2)
        if "rows" in entry:
            changes["rows"] = _int(entry["rows"], f"{at}.rows", 1)
        if "dist" in entry:
            changes["dist"] = _choice(entry["dist"], f"{at}.dist", DIST_NAMES)
        if "std" in entry:
            changes["std"] = _number(entry["std"], f"{at}.std", positive=True)
        if "seed" in entry:
            changes["seed"] = _int(entry["seed"], f"{at}.seed", 0)
        if "dtype" in entry:
            changes["dtypes"] = _dtypes(entry["dtype"], f"{at}.dtype")
        if "paths" in entry:
            changes["paths"] = _paths(entry["paths"], f"{at}.paths")
        out.append(replace(spec, **changes))
    return tuple(out)


def parse_table(
    table: Any,
    *,
    display: str = "<config>",
    prefix: str = TABLE,
    root: str | os.PathLike[str] = ".",
    path: str | None = None,
) -> CheckConfig:
    """The ``[tool.attncheck]`` table (a dict as tomllib gives it) -> a checked CheckConfig.

    Input globs are resolved relative to ``root``; one that matches nothing is an error.
    """
    table = _table(table, prefix or "the config")
    _reject_unknown(table, TOP_KEYS, prefix, display)

    def key(name: str) -> str:
        return f"{prefix}.{name}" if prefix else name

    values: dict[str, Any] = {"display": display, "path": path, "root": str(Path(root).resolve()), "prefix": prefix}
    if "inputs" in table:
        values["inputs"] = _strings(table["inputs"], key("inputs"), "globs of tensor files")
    if "keys" in table:
        values["keys"] = _strings(table["keys"], key("keys"), "globs of tensor names inside files")
    if "synthetic" in table:
        values["synthetic"] = _parse_synthetic(table["synthetic"], key("synthetic"), display)
    if "dtypes" in table:
        values["dtypes"] = _dtypes(table["dtypes"], key("dtypes"))
    if "methods" in table:
        values["methods"] = params.methods(table["methods"], key("methods"))
    if "block" in table:
        values["block"] = _int(table["block"], key("block"), 1)
    if "order" in table:
        values["order"] = _choice(table["order"], key("order"), ORDERS)
    if "accum" in table:
        values["accum"] = _choice(table["accum"], key("accum"), params.ACCUMULATIONS)
    if "device" in table:
        values["device"] = params.device(table["device"], key("device"))
    if "budget" in table:
        values["budget"], values["dtype_budgets"] = _parse_budgets(table["budget"], key("budget"), display)
    if "max_memory" in table:
        if not isinstance(table["max_memory"], (str, int)) or isinstance(table["max_memory"], bool):
            _size(table["max_memory"], key("max_memory"))  # says what a size is
        values["max_memory"] = params.memory(table["max_memory"], key("max_memory"))
    if "max_work" in table:
        values["max_work"] = max_work(table["max_work"], key("max_work"), from_text=False)
    if "ignore" in table:
        from attncheck.config.run import ignore_codes

        values["ignore"] = ignore_codes(
            _strings(table["ignore"], key("ignore"), "finding codes, e.g. fully_masked_rows"), key("ignore")
        )
    if not values.get("inputs") and not values.get("synthetic"):
        where = f"[{prefix}]" if prefix else display
        raise AttncheckError(
            f'{where} has no inputs: set {key("inputs")} = ["dumps/*.safetensors"] or add a [[{key("synthetic")}]] '
            "table"
        )
    if values.get("keys") and not values.get("inputs"):
        raise AttncheckError(f"{key('keys')} picks tensors inside files, but {key('inputs')} names no file")
    config = CheckConfig(**values)
    _check_output_budgets(config)
    for spec in config.synthetic:
        need = synthetic_bytes(spec)
        if need > config.memory_budget:
            heads, queries = head_layout(spec.rows, spec.seq)
            raise AttncheckError(
                f"{key('synthetic')}[{spec.index}]: its q and k ({heads} heads x ({queries} queries + {spec.seq} "
                f"keys) x d_k {spec.d_k}) and a head's scores need {size_text(need)}, over {key('max_memory')} "
                f"{size_text(config.memory_budget)}: lower seq, rows or d_k, or raise {key('max_memory')}"
            )
    _check_work(config)
    return replace(config, files=resolve_inputs(config))


def synthetic_work(spec: SyntheticInput, config: CheckConfig) -> int:
    """Score elements a synthetic input computes: its rows (whole heads) x keys, once per cell
    (every method x dtype on the scores; with paths, every path x dtype besides)."""
    heads, queries = head_layout(spec.rows, spec.seq)
    return heads * queries * spec.seq * len(spec.dtypes or config.dtypes) * (len(config.methods) + len(spec.paths))


def _check_work(config: CheckConfig) -> None:
    """Refuse, before anything is drawn, synthetic inputs that compute more than max_work score elements
    together: a few numbers in a config can ask for hours of work."""
    if not config.synthetic:
        return
    works = [synthetic_work(spec, config) for spec in config.synthetic]
    total = sum(works)
    if total > config.max_work:
        big = config.synthetic[works.index(max(works))]
        heads, queries = head_layout(big.rows, big.seq)  # rows rounded up to whole heads
        raise AttncheckError(
            f"{config.key('synthetic')} would compute {work_text(total)} score elements "
            f"({config.key('synthetic')}[{big.index}]: "
            f"{big.rows:,} rows x {big.seq} keys x {max(works) // (heads * queries * big.seq)} cells), over "
            f"{config.key('max_work')} {work_text(config.max_work)}: lower rows or seq, "
            f"or raise {config.key('max_work')}"
        )


def synthetic_bytes(spec: SyntheticInput) -> int:
    """What a synthetic input holds at once: drawing float64 q and k (and v for paths), then
    two heads' float64 scores (the one being cut into row blocks and the next) and a block copied from them."""
    heads, queries = head_layout(spec.rows, spec.seq)
    v = 8 * heads * spec.seq * spec.d_k if spec.paths else 0
    return qk_bytes(heads, queries, spec.seq, spec.d_k, spec.dist) + v + 3 * 8 * queries * spec.seq


def _check_output_budgets(config: CheckConfig) -> None:
    """out_* budgets judge O = P@V: some input must have V (a synthetic entry with paths);
    relative_to_torch on paths compares with the eager path's torch.softmax cell."""
    budgets = (config.budget, *config.dtype_budgets.values())
    relative = [n for n in RELATIVE_BUDGETS if any(getattr(b, n) is not None for b in budgets)]
    if relative:
        for spec in config.synthetic:
            if spec.paths and eager_path() not in spec.paths:
                raise AttncheckError(
                    f"{config.key('budget.' + relative[0])} compares each cell with torch.softmax on the eager path: "
                    f'add "eager" to {config.key("synthetic")}[{spec.index}].paths'
                )
    if any(spec.paths for spec in config.synthetic):
        return
    for where, budget in (("budget", config.budget), *((f"budget.{d}", b) for d, b in config.dtype_budgets.items())):
        names = budget.output_budgets()
        if names:
            raise AttncheckError(
                f"{config.key(where + '.' + names[0])} judges the attention output O = P@V, which needs V: add "
                f'paths = ["eager", "flash"] to a [[{config.key("synthetic")}]] entry (saved score dumps have no V)'
            )


def resolve_inputs(config: CheckConfig) -> tuple[str, ...]:
    """Every input glob -> the files and folders it matches (absolute, sorted, no duplicates)."""
    files: dict[str, None] = {}
    for pattern in config.inputs:
        if not pattern.strip():
            raise AttncheckError(f"{config.key('inputs')} holds an empty glob")
        matched = sorted(glob_inputs(pattern, config.root))
        if not matched:
            raise AttncheckError(f"{config.key('inputs')}: {pattern!r} matches no file (relative to {config.root})")
        for m in matched:
            files[os.path.normpath(os.path.join(config.root, m))] = None
    return tuple(files)


def glob_inputs(pattern: str, root: str) -> list[str]:
    """``glob.glob(pattern, root_dir=root, recursive=True)``, but a ``**`` enters each real folder once.

    Python's recursive glob follows links to folders and never stops on a folder that links to
    itself or to a parent (``ln -s . loop``): its walk grows without end. Here every ``**`` walks the
    folders below it keeping the (device, inode) of each one entered, so a loop is entered once; links
    to folders are followed (as glob does) after the real folders, so a file is found by its own path
    and once, where glob lists it again under every link. Patterns without ``**`` cannot loop and keep glob's own
    answer. Hidden names match only a part that starts with '.', as in glob."""
    if "**" not in pattern:
        return glob.glob(pattern, root_dir=root, recursive=True)
    absolute = os.path.isabs(pattern)
    parts = [p for p in pattern.split("/") if p not in ("", ".")]
    start = os.sep if absolute else ""
    out: dict[str, None] = {}

    def real(folder: str) -> tuple[int, int] | None:
        try:
            st = os.stat(os.path.join(root, folder) if folder else root)
        except (OSError, ValueError):
            return None
        return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None

    def children(folder: str) -> list[str]:
        try:
            return sorted(os.listdir(os.path.join(root, folder) if folder else root))
        except (OSError, ValueError):
            return []

    def walk(folder: str, i: int, state: tuple[set, list] | None) -> None:
        if i == len(parts):
            if folder:
                out[folder] = None
            return
        part = parts[i]
        if part == "**":
            if state is None:  # a '**' starts here: its own folders seen, and the links to folders it left for last
                state = (set(), [])
                expand(folder, i, state)
                while state[1]:  # links after the real folders, so that a folder is found by its own name first
                    expand(state[1].pop(0), i, state)
            else:
                expand(folder, i, state)
            return
        if part == "..":
            walk(os.path.join(folder, part), i + 1, None)
            return
        if not glob.has_magic(part):
            sub = os.path.join(folder, part)
            if os.path.lexists(os.path.join(root, sub)) and (i + 1 == len(parts) or real(sub) is not None):
                walk(sub, i + 1, None)
            return
        for name in children(folder):
            if name.startswith(".") and not part.startswith("."):
                continue
            if fnmatch.fnmatch(name, part):
                sub = os.path.join(folder, name)
                if i + 1 == len(parts) or real(sub) is not None:
                    walk(sub, i + 1, None)

    def expand(folder: str, i: int, state: tuple[set, list]) -> None:
        """'**' at ``folder``: no folder at all, then every folder below it (each real one once)."""
        seen, links = state
        key = real(folder)
        if key is None or key in seen:
            return
        seen.add(key)
        walk(folder, i + 1, None)  # '**' as no folder at all
        for name in children(folder):
            if name.startswith("."):
                continue
            sub = os.path.join(folder, name)
            if real(sub) is None:
                if i + 1 == len(parts):  # a final '**' lists files too
                    out[sub] = None
            elif os.path.islink(os.path.join(root, sub)):
                links.append(sub)
            else:
                expand(sub, i, state)

    walk(start, 0, None)
    return list(out)


# --------------------------------------------------------------------------- files


def _display(path: Path) -> str:
    """A path as messages show it: relative to the current directory when below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)


MAX_CONFIG_BYTES = 16 * 1024 * 1024  # a config is a few lines; anything this large is not one


def _read_toml(path: Path, display: str) -> dict[str, Any]:
    if _toml is None:  # pragma: no cover - Python 3.10 without tomli
        raise AttncheckError(
            "reading the config needs Python >= 3.11 (tomllib) or the tomli package: pip install tomli"
        )
    try:
        with open(path, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # /dev/zero, a pipe: would never end
                raise AttncheckError(f"config {display}: not a regular file; give a TOML file")
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise AttncheckError(f"cannot read {display}: {e.strerror or e}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise AttncheckError(f"config {display}: larger than {MAX_CONFIG_BYTES // 1024**2} MiB, so not a config file")
    try:
        return _toml.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise AttncheckError(f"{display}: not a UTF-8 text file ({e.reason} at byte {e.start})") from None
    except _toml.TOMLDecodeError as e:  # the message ends with '(at line L, column C)'
        raise AttncheckError(f"{display}: invalid TOML: {e}") from None
    except RecursionError:  # tomllib reads arrays and inline tables recursively
        raise AttncheckError(f"{display}: arrays or tables nested too deep to be a config") from None
    except ValueError:  # an integer past Python's int-string limit (4,300 digits)
        raise AttncheckError(f"{display}: holds an integer of more than 4,300 digits, which no setting takes") from None


def _attncheck_table(doc: dict[str, Any]) -> Any:
    tool = doc.get("tool")
    if isinstance(tool, dict) and "attncheck" in tool:
        return tool["attncheck"]
    return None


def load_config(path: str | os.PathLike[str]) -> CheckConfig:
    """Read a config file: a pyproject.toml with [tool.attncheck] (or any TOML file holding
    that table), or a standalone attncheck.toml whose top level is the table itself."""
    p = Path(path)
    display = _display(p)
    try:
        kind = p.stat().st_mode
    except FileNotFoundError:
        raise AttncheckError(f"config {display}: no such file") from None
    except (OSError, ValueError) as e:  # a name too long, a loop of links
        raise AttncheckError(f"config {display}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    if stat.S_ISDIR(kind):
        raise AttncheckError(f"config {display}: is a folder; give a TOML file")
    doc = _read_toml(p, display)
    table = _attncheck_table(doc)
    if table is not None:
        prefix = TABLE
    elif p.name == PYPROJECT:
        raise AttncheckError(f"{display} has no [{TABLE}] table")
    else:
        table, prefix = doc, ""
    return parse_table(table, display=display, prefix=prefix, root=p.resolve().parent, path=str(p.resolve()))


def find_config(start: str | os.PathLike[str] | None = None) -> Path:
    """Walk up from ``start`` (the current directory): in each folder an attncheck.toml wins,
    then a pyproject.toml that has a [tool.attncheck] table (one without it is passed over)."""
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        standalone = folder / STANDALONE
        if standalone.is_file():
            return standalone
        pyproject = folder / PYPROJECT
        if pyproject.is_file() and _attncheck_table(_read_toml(pyproject, _display(pyproject))) is not None:
            return pyproject
    raise AttncheckError(
        f"no config found: no {STANDALONE}, and no {PYPROJECT} with a [{TABLE}] table, in {here} or its parents; "
        "add one or pass --config FILE"
    )


__all__ = [
    "BUDGET_NAMES",
    "Budget",
    "CheckConfig",
    "SyntheticInput",
    "find_config",
    "load_config",
    "parse_budget",
    "parse_table",
    "resolve_inputs",
]
