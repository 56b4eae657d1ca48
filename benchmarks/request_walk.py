"""The walks of one request through attncheck's modules (issue 35: "one request goes back and forth").

Three walks, each under ``sys.setprofile``, of a 2-layer Llama (SDPA, random init from a config):

- ``run``: ``attncheck run CAPTURE`` on a capture of one forward pass (recorded before the walk starts);
- ``capture``: ``attncheck capture --out DIR -- script.py``, the script running that forward pass;
- ``diagnose``: ``with attncheck.capture(diagnose=True): model(ids)``, the library call.

Every Python call into an attncheck module from another module is an entry into the callee. Its call site is the
caller's ``module:line``; where the caller is not attncheck's (torch calling the recorder's hooks, click calling
the CLI, runpy running the script), the site is that of the nearest attncheck frame up the stack, or ``<outside>``
where there is none (the model's own code calling the library). Calls made while an attncheck module is being
imported (its body running) are not the request's and are not counted. Per module:

- raw: every entry (what the first version of this script counted: a per-chunk loop enters ``numerics.reduce``
  once per chunk and per statistic);
- reads: entries that read a value rather than run code: a property getter, a method a dataclass generated
  (``__init__``, ``__eq__``, ``__hash__`` of a ``CellKey`` used as a dict key), an implicit dunder; not crossings;
- crossings: the distinct call sites of the other entries. A loop enters from the same site at every iteration (a
  generator's resumption is an entry from the ``for`` line that resumes it), so it counts once however many chunks,
  cells or calls it runs over: a crossing is a place where control passes into the module, not a repetition;
- funcs: the distinct calling functions; from: the modules it is entered from; climb: the climbs into it.

Rooms and the floor, by a mechanical rule: a module is a floor module when its layer (``LAYERS``) is the floor's
(1 or 0: options, dtypes, devices, sources, draws, registry, params, and the data and text every layer reads:
results, format, errors), or when the attncheck modules it imports (at any depth of its code, function-level imports
too, those under ``if TYPE_CHECKING:`` not) are all the floor's by that table: such a module reaches no room, so a call
into it returns to its caller without going anywhere (``numerics.reduce``, ``numerics.precision``,
``numerics.rowmath``, ``cli.common``). Every other module is a room of the request. The floor is listed apart, with
its own counts, not left out.

Rooms that enter each other (A calls into B and B into A, from any sites) are control going back and forth: with no
import cycle (``tests/test_layers.py``), only a callback or an object handed over can do it; they are listed.

A climb back up is a direct call into a module of a higher layer than its caller's (both above 0): numerics calling
the judgement, for example; a library calling back an object a higher layer handed down (rich measuring the CLI's
console) is not the lower layer naming the higher one, and is no climb. Climbs are counted raw and folded by site.
Layers, from the top: cli and the library's front door (the ``attncheck`` package), pipelines, report, judgement
(judge, model, model_decode, findings, codes), the computing layers (numerics, loaders, record, watcher), config,
the floor (options, dtypes, devices, sources, draws, registry, params; results, format and errors at 0).

    python benchmarks/request_walk.py [--json OUT] [--walk run|capture|diagnose ...]

prints, per walk, each room's counts, then the floor's, the climbs by site, and the sites of every room crossed
more than twice. ``tests/benchmarks/test_request_walk.py`` holds the figures. Run it on another tree with
PYTHONPATH=that/tree to compare.
"""

from __future__ import annotations

import argparse
import ast
import collections
import functools
import json
import os
import sys
import tempfile
import textwrap
from pathlib import Path

if not os.environ.get("PYTHONPATH"):  # the repository's own attncheck first, unless one is asked for
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYERS = (  # (module prefix, layer): higher calls lower
    ("attncheck.cli", 7),
    ("attncheck.pipelines", 6),
    ("attncheck.report", 5),
    ("attncheck.judge", 4),
    ("attncheck.model", 4),
    ("attncheck.model_decode", 4),
    ("attncheck.findings", 4),
    ("attncheck.codes", 4),
    ("attncheck.numerics", 3),
    ("attncheck.loaders", 3),
    ("attncheck.record", 3),
    ("attncheck.watcher", 3),
    ("attncheck.config", 2),
    ("attncheck.options", 1),
    ("attncheck.dtypes", 1),
    ("attncheck.devices", 1),
    ("attncheck.sources", 1),
    ("attncheck.draws", 1),
    ("attncheck.registry", 1),
    ("attncheck.params", 1),
)
FRONT_DOOR = 7  # the ``attncheck`` package itself: ``attncheck.capture`` and the other names the library exports
FLOOR_LAYER = 1
OUTSIDE = "<outside>"
WALKS = ("run", "capture", "diagnose")

MODEL = """
import torch
import transformers

torch.manual_seed(0)
cfg = transformers.LlamaConfig(
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    hidden_size=64,
    intermediate_size=128,
    vocab_size=128,
    max_position_embeddings=64,
)
model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
ids = torch.randint(0, 128, (1, 32))
"""
SCRIPT = MODEL + "\nwith torch.no_grad():\n    model(ids)\n"  # what ``attncheck capture`` runs


def layer(module: str) -> int:
    """The module's layer; 0 for data and text every layer reads (results, format, errors)."""
    if module == "attncheck":
        return FRONT_DOOR
    return next((n for prefix, n in LAYERS if module == prefix or module.startswith(prefix + ".")), 0)


def _modules() -> dict[str, Path]:
    import attncheck

    root = Path(attncheck.__file__).resolve().parent
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def runtime_imports(path: Path, modules: set[str]) -> set[str]:
    """The attncheck modules a file imports when it runs: at any depth (function-level imports too), those under
    ``if TYPE_CHECKING:`` left out; ``from P import x`` is the submodule P.x where there is one, else P."""
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("attncheck"):
            found.update(
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names
            )
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("attncheck"))
    return {m for m in found if m in modules}


def floor_modules() -> set[str]:
    """The floor: modules of the floor's layers, and modules that import nothing above them (see the docstring)."""
    files = _modules()
    names = set(files)
    floor = set()
    for module, path in files.items():
        if 0 <= layer(module) <= FLOOR_LAYER and module != "attncheck":
            floor.add(module)
        elif module != "attncheck" and all(
            layer(m) <= FLOOR_LAYER and m != "attncheck" for m in runtime_imports(path, names) - {module}
        ):
            floor.add(module)
    return floor


def _importing(frame) -> bool:
    """Whether an attncheck module's body is running on this stack (its import: not the request's walk)."""
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__", "").startswith("attncheck"):
            return True
        frame = frame.f_back
    return False


CALLS = ("__init__", "__call__", "__enter__", "__exit__", "__iter__", "__next__")  # dunders that run code


def _value_codes() -> set:
    """The code objects of attncheck's property getters (a read of a value the caller holds, not a crossing)."""
    codes = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("attncheck") or module is None:
            continue
        for cls in vars(module).values():
            if isinstance(cls, type) and cls.__module__ == name:
                for attr in vars(cls).values():
                    if isinstance(attr, property) and attr.fget is not None:
                        codes.add(getattr(attr.fget, "__code__", None))
                    elif isinstance(attr, functools.cached_property):
                        codes.add(attr.func.__code__)
    return codes


def is_read(code, properties: set) -> bool:
    """A read of a value rather than a call of code: a property getter, a method a dataclass generated
    (``__eq__``, ``__hash__``, ``__repr__``, its ``__init__``: compiled from a string), or a dunder the
    interpreter calls implicitly (``__hash__`` of a dict key, ``__len__``, ``__getitem__``, ...)."""
    name = code.co_name
    dunder = name.startswith("__") and name.endswith("__") and name not in CALLS
    return code in properties or code.co_filename == "<string>" or dunder


class Profile:
    """The entries of one walk, each with its callee, caller, call site, calling function and code, whether the
    caller called it directly (not through a library); counted as the docstring says by ``result``."""

    def __init__(self) -> None:
        self.events: collections.Counter = collections.Counter()

    def __call__(self, frame, event, arg) -> None:
        if event != "call":
            return
        callee = frame.f_globals.get("__name__", "")
        if not callee.startswith("attncheck") or _importing(frame):
            return
        back = frame.f_back
        direct = back is not None and back.f_globals.get("__name__", "").startswith("attncheck")
        while back is not None and not back.f_globals.get("__name__", "").startswith("attncheck"):
            back = back.f_back  # torch, click, runpy, the model's code: the nearest attncheck frame called it
        caller = OUTSIDE if back is None else back.f_globals["__name__"]
        if caller == callee:
            return
        site = OUTSIDE if back is None else f"{caller}:{back.f_lineno}"
        function = OUTSIDE if back is None else f"{caller}.{back.f_code.co_qualname}"
        self.events[(callee, caller, site, function, frame.f_code, direct)] += 1

    def result(self, exit_code: int, floor: set[str]) -> dict:
        properties = _value_codes()
        entries, reads = collections.Counter(), collections.Counter()
        sites, functions, callers = (collections.defaultdict(collections.Counter) for _ in range(3))
        climbs, climb_sites, climbs_into = collections.Counter(), collections.Counter(), collections.Counter()
        for (callee, caller, site, function, code, direct), n in self.events.items():
            entries[callee] += n
            if is_read(code, properties):
                reads[callee] += n
                continue
            sites[callee][site] += n
            functions[callee][function] += n
            callers[callee][caller] += n
            # a climb is a direct call: a library calling back what a higher layer handed down (rich measuring
            # the CLI's console) is not the lower layer naming the higher one
            if direct and layer(callee) > layer(caller) > 0:
                climbs[f"{caller} -> {callee}"] += n
                climb_sites[f"{site} -> {callee}"] += n
                climbs_into[callee] += n

        def row(m: str) -> dict:
            return {
                "layer": layer(m),
                "entries": entries[m],
                "reads": reads[m],
                "crossings": len(sites[m]),
                "functions": len(functions[m]),
                "from": sorted(callers[m]),
                "climbs": climbs_into[m],
                "sites": dict(sites[m].most_common()),
            }

        def ordered(names):
            return sorted(names, key=lambda m: (-len(sites[m]), -entries[m], m))

        rooms = {m: row(m) for m in ordered(m for m in entries if m not in floor)}
        edges = {(c, m) for m, r in rooms.items() for c in r["from"] if c in rooms}
        return {
            "exit_code": exit_code,
            "modules": len(entries),
            "entries": sum(entries.values()),
            "reads": sum(reads.values()),
            "crossings": sum(len(s) for s in sites.values()),
            "rooms": rooms,
            "floor": {m: row(m) for m in ordered(m for m in entries if m in floor)},
            # rooms that enter each other: control going from one to the other and back (no import cycle lets a
            # room name one that names it, so this is a callback or an object handed over)
            "back_and_forth": sorted({tuple(sorted(e)) for e in edges if (e[1], e[0]) in edges}),
            "climbs": dict(climbs.most_common()),
            "climb_sites": dict(climb_sites.most_common()),
        }


def profiled(work) -> tuple[Profile, object]:
    profile = Profile()
    sys.setprofile(profile)
    try:
        out = work()
    finally:
        sys.setprofile(None)
    return profile, out


def _cli(args: list[str]) -> int:
    from typer.testing import CliRunner

    from attncheck.cli import app

    result = CliRunner().invoke(app, args)
    if result.exit_code != 0:
        print(result.output, file=sys.stderr)
    return result.exit_code


def _model() -> dict:
    space: dict = {}
    exec(MODEL, space)
    return space


def walk_run(tmp: Path, floor: set[str]) -> dict:
    """``attncheck run CAPTURE``, the capture recorded before the walk starts."""
    import torch

    import attncheck

    space = _model()
    with torch.no_grad(), attncheck.capture(tmp / "cap"):
        space["model"](space["ids"])
    profile, code = profiled(lambda: _cli(["run", str(tmp / "cap"), "--json", os.devnull]))
    return profile.result(code, floor)


def walk_capture(tmp: Path, floor: set[str]) -> dict:
    """``attncheck capture --out DIR -- script.py``: the script's model recorded, then ``run`` on the directory."""
    script = tmp / "model_script.py"
    script.write_text(SCRIPT)
    profile, code = profiled(
        lambda: _cli(["capture", "--out", str(tmp / "cap2"), "--json", os.devnull, "--", str(script)])
    )
    return profile.result(code, floor)


def walk_diagnose(tmp: Path, floor: set[str]) -> dict:
    """``with attncheck.capture(diagnose=True): model(ids)``: each call diagnosed as it comes."""
    import torch

    import attncheck

    space = _model()

    def work() -> int:
        with torch.no_grad(), attncheck.capture(diagnose=True) as cap:
            space["model"](space["ids"])
        return 0 if cap.result is not None and cap.result.model is not None and cap.error is None else 1

    profile, code = profiled(work)
    return profile.result(code, floor)


def show(name: str, out: dict) -> None:
    rooms, low = out["rooms"], out["floor"]
    print(f"== {name}: exit {out['exit_code']}, {out['modules']} modules entered: {len(rooms)} rooms, {len(low)} floor")
    print(
        f"   entries {out['entries']} raw ({out['reads']} reads of a value), {out['crossings']} crossings (call "
        f"sites); most crossings of a room {max((r['crossings'] for r in rooms.values()), default=0)}"
    )
    print(f"   climbs back up: {sum(out['climbs'].values())} raw, {len(out['climb_sites'])} sites")
    pairs = "; ".join(" <-> ".join(p) for p in out["back_and_forth"]) or "none"
    print(f"   rooms entering each other: {pairs}")
    head = f"{'raw':>5} {'reads':>5} {'cross':>5} {'funcs':>5} {'climb':>5}"
    print(f"   {'room':42} {'layer':>5} {head}  entered from")
    for m, r in rooms.items():
        counts = f"{r['entries']:>5} {r['reads']:>5} {r['crossings']:>5} {r['functions']:>5} {r['climbs']:>5}"
        print(f"   {m:42} {r['layer']:>5} {counts}  {', '.join(r['from'])}")
    print(f"   {'floor':42} {'layer':>5} {head}")
    for m, r in low.items():
        print(f"   {m:42} {r['layer']:>5} {r['entries']:>5} {r['reads']:>5} {r['crossings']:>5} {r['functions']:>5}")
    for edge, n in out["climb_sites"].items():
        print(f"   climb {edge}: {n}")
    for m, r in rooms.items():
        if r["crossings"] > 2:
            sites = ", ".join(f"{s} ({n})" for s, n in r["sites"].items())
            print(textwrap.fill(f"{m} entered from {sites}", 118, initial_indent="   ", subsequent_indent="     "))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--walk", action="append", choices=WALKS, help="the walks to take (default: all three)")
    opts = parser.parse_args()
    floor = floor_modules()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in opts.walk or WALKS:
            out[name] = globals()[f"walk_{name}"](Path(tmp), floor)
            show(name, out[name])
    if opts.json:
        Path(opts.json).write_text(json.dumps(out, indent=2))
    return 0 if all(w["exit_code"] == 0 for w in out.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
