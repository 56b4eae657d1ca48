"""Docs are tested: every example script runs, and every command in the README's
console blocks runs with the exit code written beside it (`# exit N`, default 0).

These run whole commands in subprocesses (about 2.5 minutes on 2 cores): they are marked
slow, kept out of the default run, and run by `.ci/run` (`pytest -m slow`)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))


def env_with_venv_first():
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["COLUMNS"] = "100"
    return env


@pytest.mark.slow
@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script, tmp_path):
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=script.parent, capture_output=True, text=True, timeout=300, env=env_with_venv_first())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def readme_commands(path=ROOT / "README.md"):
    text = path.read_text()
    commands = []
    for block in re.findall(r"```console\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            if line.startswith("$ "):
                cmd, _, note = line[2:].partition("#")
                m = re.search(r"exit (\d+)", note)
                commands.append((cmd.strip(), int(m.group(1)) if m else 0))
    return commands


def test_readme_has_commands():
    assert len(readme_commands()) >= 5


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_doc_commands_run_in_order(doc, tmp_path):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = env_with_venv_first()
    for cmd, expected in readme_commands(doc):
        proc = subprocess.run(cmd, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == expected, f"{cmd!r} exited {proc.returncode}, expected {expected}:\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}"
        assert "Traceback" not in proc.stderr, cmd
