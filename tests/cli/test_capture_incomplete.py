"""A capture that did not record every call is a finding (capture_incomplete, a warning): a CI gate
`--fail-on warning` fails on it, and the report names the first call not recorded and why."""

import json
import textwrap

from typer.testing import CliRunner

from attncheck.cli import app

runner = CliRunner()

# Four layers of the same SDPA call, each q, k, v of 1x2x16x32 fp32: 3 x 4096 bytes = 12288 bytes per call.
SCRIPT = textwrap.dedent("""
    import torch
    import torch.nn.functional as F

    class Layer(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer() for _ in range(4)])

        def forward(self, q, k, v):
            for layer in self.layers:
                layer(q, k, v)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 32, generator=g) for _ in range(3))
    with torch.no_grad():
        Net()(q, k, v)
""")
CALL_BYTES = 3 * 2 * 16 * 32 * 4


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def test_a_capture_stopped_by_max_bytes_fails_fail_on_warning_and_names_the_first_call_not_recorded(tmp_path):
    script = tmp_path / "layers.py"
    script.write_text(SCRIPT)
    cap = tmp_path / "cap"
    r = invoke("capture", "--out", cap, "--max-bytes", str(3 * CALL_BYTES + 100), script)  # room for 3 calls of 4
    assert r.exit_code == 0, r.output  # no --fail-on asked
    doc = json.loads((cap / "manifest.json").read_text())
    assert len(doc["calls"]) == 3 and doc["first_unrecorded"] == {
        "index": 3,
        "kind": "sdpa",
        "module": "layers.3",
        "what": "call",
    }

    r = invoke("run", cap, "--fail-on", "error,warning,nan")
    assert r.exit_code == 1, r.output
    last = " ".join(r.stdout.strip().split("\n\n")[-1].split())  # the closing line (wrapped by the terminal width)
    assert (
        "0 error(s), 1 warning(s)" in last
        and "capture incomplete: call 3 (sdpa in layers.3) and every call after it not recorded" in last
    )
    assert "attncheck: --fail-on warning: capture: capture_incomplete" in r.stderr

    r = invoke("run", cap, "--json", "-")
    assert r.exit_code == 0
    found = json.loads(r.stdout)["model"]["findings"]
    assert [(f["code"], f["severity"]) for f in found] == [("capture_incomplete", "warning")]
    assert (
        "call 3 (sdpa in layers.3)" in found[0]["message"]
        and f"max_bytes {3 * CALL_BYTES + 100} would be passed by call 3" in found[0]["message"]
    )

    r = invoke("run", cap, "--fail-on", "warning", "--ignore", "capture_incomplete")
    assert r.exit_code == 0, r.output

    r = invoke("run", cap, "--summary", "--fail-on", "warning")  # the one-screen answer says it too
    assert r.exit_code == 1, r.output
    first = r.stdout.splitlines()[0]
    assert first.startswith("WARNING") and "1 warning" in first, r.stdout
    assert "warning[capture_incomplete]" in r.stdout and "call 3 (sdpa in layers.3)" in " ".join(r.stdout.split())


def test_a_complete_capture_raises_no_capture_incomplete(tmp_path):
    script = tmp_path / "layers.py"
    script.write_text(SCRIPT)
    cap = tmp_path / "cap"
    r = invoke("capture", "--out", cap, "--fail-on", "error,warning,nan", "--json", "-", script)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["model"]["findings"] == [] and len(doc["model"]["calls"]) == 4
    assert json.loads((cap / "manifest.json").read_text())["first_unrecorded"] is None


def test_no_save_capture_stopped_by_max_calls_is_incomplete_too(tmp_path):
    script = tmp_path / "layers.py"
    script.write_text(SCRIPT)
    r = invoke("capture", "--no-save", "--max-calls", "2", "--fail-on", "warning", "--json", "-", script)
    assert r.exit_code == 1, r.output
    found = json.loads(r.stdout)["model"]["findings"]
    assert (
        len(found) == 1
        and "call 2 (sdpa in layers.2) and every call after it not recorded (recording stopped: max_calls 2"
        in found[0]["message"]
    )


def test_gradients_not_recorded_make_the_capture_incomplete_and_are_named():
    import torch
    import torch.nn.functional as F

    import attncheck

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 32, generator=g).requires_grad_() for _ in range(3))
    forward = 4 * 2 * 16 * 32 * 4  # q, k, v and the output, fp32
    with attncheck.capture(diagnose=True, max_bytes=forward) as cap:  # room for the call, not its gradients
        F.scaled_dot_product_attention(q, k, v).sum().backward()
    found = cap.result.model.findings
    assert [(f.code, f.severity) for f in found] == [("capture_incomplete", "warning")]
    assert found[0].message.startswith(
        "capture incomplete: the gradients of call 0 (sdpa in global) and every call after it not recorded"
    )
