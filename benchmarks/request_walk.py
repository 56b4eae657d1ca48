"""The walk of one `attncheck run CAPTURE` request through attncheck's modules (issue 35: "one request goes back
and forth").

A 2-layer Llama (SDPA, random init from a config) is captured, then ``attncheck run`` runs on the capture with
``sys.setprofile`` on: every Python call from one attncheck module into another is an entry into the callee
('a room'), and an entry from a module of a lower layer into one of a higher layer is a climb back up (numerics
calling the judgement, for example). Layers, from the top: cli, pipelines, report, judgement (judge, model,
findings, codes), the computing layers (numerics, loaders, record), config, the floor (options, dtypes, devices,
sources, draws) and the registries beside it (registry, params; results and format hold data and text).

    python benchmarks/request_walk.py [--json OUT]

prints the rooms entered, the entries of the busiest, and every climb with its count. Run it on another tree with
PYTHONPATH=that/tree to compare.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path

if not os.environ.get("PYTHONPATH"):  # the repository's own attncheck first, unless one is asked for
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYERS = (  # (module prefix, layer): higher calls lower
    ("attncheck.cli", 7),
    ("attncheck.pipelines", 6),
    ("attncheck.report", 5),
    ("attncheck.judge", 4),
    ("attncheck.model", 4),
    ("attncheck.findings", 4),
    ("attncheck.codes", 4),
    ("attncheck.numerics", 3),
    ("attncheck.loaders", 3),
    ("attncheck.record", 3),
    ("attncheck.config", 2),
    ("attncheck.options", 1),
    ("attncheck.dtypes", 1),
    ("attncheck.devices", 1),
    ("attncheck.sources", 1),
    ("attncheck.draws", 1),
    ("attncheck.registry", 1),
    ("attncheck.params", 1),
)


def layer(module: str) -> int:
    """The module's layer; 0 for data and text every layer reads (results, format, errors)."""
    return next((n for prefix, n in LAYERS if module == prefix or module.startswith(prefix + ".")), 0)


def walk(args: list[str]) -> dict:
    """Run ``attncheck`` with ``args`` under the profiler: its exit code, the entries per module, the climbs."""
    from typer.testing import CliRunner

    from attncheck.cli import app

    entries: collections.Counter = collections.Counter()
    climbs: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event != "call" or frame.f_back is None:
            return
        callee = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "")
        if callee == caller or not callee.startswith("attncheck") or not caller.startswith("attncheck"):
            return
        entries[callee] += 1
        if layer(callee) > layer(caller) > 0:
            climbs[f"{caller} -> {callee}"] += 1

    sys.setprofile(profile)
    try:
        result = CliRunner().invoke(app, args)
    finally:
        sys.setprofile(None)
    return {
        "exit_code": result.exit_code,
        "rooms": len(entries),
        "entries": dict(entries.most_common()),
        "climbs": dict(climbs.most_common()),
    }


def capture(folder: Path) -> None:
    import torch
    import transformers

    import attncheck

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
    with torch.no_grad(), attncheck.capture(folder):
        model(torch.randint(0, 128, (1, 32)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the figures to this file")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        capture(Path(tmp) / "cap")
        out = walk(["run", str(Path(tmp) / "cap"), "--json", os.devnull])
    print(f"attncheck run CAPTURE: exit {out['exit_code']}, {out['rooms']} modules entered")
    print("busiest:", ", ".join(f"{m} {n}" for m, n in list(out["entries"].items())[:6]))
    print(f"climbs back up: {sum(out['climbs'].values())} calls over {len(out['climbs'])} edges")
    for edge, n in out["climbs"].items():
        print(f"  {edge}: {n}")
    if opts.json:
        Path(opts.json).write_text(json.dumps(out, indent=2))
    return 0 if out["exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
