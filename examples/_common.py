"""Shared by the examples: run `attncheck run` on a file and check the finding it should report."""

from __future__ import annotations

import json
import subprocess
import sys


def diagnose_and_expect(path: str, expected_codes: set[str], *extra: str) -> None:
    """Print the tables, then check the JSON report holds the expected finding codes."""
    cmd = [sys.executable, "-m", "attncheck", "run", path, *extra]
    print("$", " ".join(["attncheck", "run", path, *extra]), flush=True)
    subprocess.run(cmd, check=True)
    report = json.loads(subprocess.run([*cmd, "--json", "-"], check=True, capture_output=True, text=True).stdout)
    found = {f["code"] for t in report["tensors"] for f in t["findings"]}
    missing = expected_codes - found
    if missing:
        sys.exit(f"expected findings {sorted(missing)} not reported (found {sorted(found)})")
    print(f"\nreported as expected: {', '.join(sorted(expected_codes))}")
