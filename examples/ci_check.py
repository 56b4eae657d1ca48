"""attncheck as a CI smoke check: a config that passes and one that must fail.

Writes into OUTDIR the dumps of examples/ci/make_dumps.py, the example
pyproject.toml of examples/ci/ (budgets that hold), and unscaled_fp16.toml: a
head that forgot 1/sqrt(d_k), put through a textbook softmax in fp16, whose
exp overflows. Then runs `attncheck check` on both, as a CI job would, and
reads the failing case back from the JUnit file.

    python examples/ci_check.py [OUTDIR]
"""

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import torch
from _common import output_dir

from attncheck.testing import assert_softmax_ok

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "ci"))
from make_dumps import write_dumps  # noqa: E402

UNSCALED_FP16 = """\
# A standalone config (attncheck.toml style: the [tool.attncheck] table at the top level).
# d_k = 128 logits without 1/sqrt(d_k) have std ~11.3: exp overflows fp16 above ln(65520) ~ 11.09.
dtypes = ["fp16"]
methods = ["naive", "stable", "torch"]

[budget]
nan = 0
overflow = 0

[[synthetic]]
d_k = 128
scale = "none"
seq = 128
rows = 256
"""


def attncheck(*args: str, cwd: Path) -> int:
    env = {k: v for k, v in os.environ.items() if k != "GITHUB_STEP_SUMMARY"}  # keep the demo out of a real job summary
    print(f"\n$ attncheck {' '.join(args)}    (in {cwd})", flush=True)
    return subprocess.run([sys.executable, "-m", "attncheck", *args], cwd=cwd, env=env).returncode


out = output_dir()
write_dumps(out / "dumps")
shutil.copy(HERE / "ci" / "pyproject.toml", out / "pyproject.toml")
(out / "unscaled_fp16.toml").write_text(UNSCALED_FP16)

passing = attncheck("check", "--junit", "attncheck-junit.xml", "--markdown", "attncheck.md", cwd=out)
if passing != 0:
    sys.exit(f"expected the example config to pass (exit 0), got exit {passing}")

failing = attncheck("check", "--config", "unscaled_fp16.toml", "--junit", "failing-junit.xml", cwd=out)
if failing != 1:
    sys.exit(f"expected the unscaled fp16 config to break its budget (exit 1), got exit {failing}")

suite = ET.parse(out / "failing-junit.xml").getroot()
failed = [
    (tc.get("classname"), tc.get("name"), tc.find("failure").get("message"))
    for tc in suite.iter("testcase")
    if tc.find("failure") is not None
]
print(f"\nJUnit: {suite.get('tests')} test(s), {suite.get('failures')} failure(s)")
for classname, name, message in failed:
    print(f"  {classname} {name}: {message}")
if [name for _, name, _ in failed] != ["naive/fp16"]:
    sys.exit(f"expected exactly naive/fp16 to fail, got {[name for _, name, _ in failed]}")
print("\nas expected: the example config passes, naive/fp16 on unscaled logits breaks nan and overflow")

# The same budgets inside a pytest test over your own module: assert_softmax_ok.
g = torch.Generator().manual_seed(0)
q, k = torch.randn(2, 64, 128, generator=g), torch.randn(2, 64, 128, generator=g)  # (H, T, d_k)
assert_softmax_ok(
    q @ k.transpose(-1, -2) / 128**0.5, dtype="bf16", method="tiled", max_abs_err=1e-2, relative_to_torch=2.0
)
try:
    assert_softmax_ok(q @ k.transpose(-1, -2), dtype="fp16", method="naive")  # no 1/sqrt(d_k)
except AssertionError as e:
    print(f"\nassert_softmax_ok on unscaled logits: {e}")
else:
    sys.exit("expected assert_softmax_ok to fail on unscaled fp16 logits")
