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

import os
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from attncheck import params
from attncheck.config.budgets import _check_output_budgets, _parse_budgets, parse_budget
from attncheck.config.inputs import glob_inputs as glob_inputs
from attncheck.config.inputs import resolve_inputs
from attncheck.config.run import Options, chunk_elements_for, ignore_codes
from attncheck.config.sweep import DEFAULT_MAX_WORK, head_layout, max_work
from attncheck.config.synthetic import SyntheticInput, _check_work, _parse_synthetic, synthetic_bytes
from attncheck.config.values import _choice, _dtypes, _int, _reject_unknown, _size, _strings, _table
from attncheck.errors import AttncheckError
from attncheck.format import size_text
from attncheck.params import ORDERS
from attncheck.registry import dtype_names
from attncheck.results import BUDGET_NAMES, Budget

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
