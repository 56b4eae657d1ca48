"""Shared by the examples: run `attncheck run` on a file and check the finding it should report."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path


def output_dir() -> Path:
    """The directory named on the command line (created if needed), else a fresh temporary one."""
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    return out


def diagnose_and_expect(path: str, expected_codes: set[str], *extra: str, report: str | None = None) -> None:
    """Run `attncheck run` (tables on the terminal, JSON to a file) and check the finding codes.

    ``path`` is the score file ('' when the scores come from --q/--k in ``extra``).
    """
    report_path = Path(report) if report else Path(path).with_suffix(".report.json")
    args = ["run", *([path] if path else []), *extra, "--json", str(report_path)]
    print("$ attncheck", " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "attncheck", *args], check=True)
    report = json.loads(report_path.read_text())
    found = {f["code"] for t in report["tensors"] for f in t["findings"]}
    missing = expected_codes - found
    if missing:
        sys.exit(f"expected findings {sorted(missing)} not reported (found {sorted(found)})")
    print(f"\nreported as expected: {', '.join(sorted(expected_codes))}")
