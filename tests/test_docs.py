"""Docs are tested: every example script runs, and every command in the console blocks of the
README and of every page under docs/ runs with the exit code written beside it (`# exit N`,
default 0); the README stays the short front door; links resolve; every page is in the site.

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
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        cwd=script.parent,
        capture_output=True,
        text=True,
        timeout=300,
        env=env_with_venv_first(),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


# Every page of the site, and the README. The findings reference's examples need the Python
# beside each command: tests/test_codes.py runs each one with it.
FINDINGS_PAGE = ROOT / "docs" / "reference" / "findings.md"
PAGES = sorted((ROOT / "docs").rglob("*.md"))
DOCS = [ROOT / "README.md", *(p for p in PAGES if p != FINDINGS_PAGE)]


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
    assert len(readme_commands()) >= 3
    assert sum(len(readme_commands(doc)) for doc in DOCS) >= 40


README_LINES = 200


def test_readme_is_the_front_door():
    """Short, with the quick start's two commands exactly (CI runs them), and links into docs/."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_LINES
    quick = text.split("## Quick start\n", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert quick.splitlines() == ["pip install . && attncheck sweep", 'pip install -e ".[test]" && pytest']
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install -q . && attncheck sweep" in ci and 'pip install -q -e ".[test]" && pytest' in ci


def test_links_between_pages_resolve():
    """Relative links of the README and of every page name a file that exists (the site build
    checks anchors too, with mkdocs build --strict)."""
    for page in [ROOT / "README.md", *PAGES]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).resolve().exists(), f"{page.relative_to(ROOT)} links to {target}"


def test_every_page_is_in_the_site_navigation():
    nav = re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    assert sorted(nav) == sorted(str(p.relative_to(ROOT / "docs")) for p in PAGES)


def test_no_paragraph_is_cut_short():
    """Prose paragraphs (not code, tables, lists or headings) start as a sentence does and end with
    one: a paragraph cut in the middle (docs/capture.md once ended one at 'width', and its rest
    opened a paragraph of docs/performance.md with '768, ...') fails here."""
    cut = []
    for page in [ROOT / "README.md", *PAGES]:
        text = re.sub(r"```.*?```|<!--.*?-->", "", page.read_text(), flags=re.S)
        for para in (p.strip() for p in re.split(r"\n\s*\n", text)):
            if not para or para.startswith(("#", "|", "-", "*", ">")) or re.match(r"\d+\. ", para):
                continue
            starts = re.match(r"[A-Z`*\[(\"']|(torch|attncheck)\b", para)
            ends = re.search(r"[.:!?)`]$", para.splitlines()[-1].rstrip())
            if not (starts and ends):
                cut.append(f"{page.relative_to(ROOT)}: {para[:40]!r} ... {para[-40:]!r}")
    assert cut == []


def test_the_home_page_links_every_guide():
    """docs/index.md lists each guide of the site's navigation (it once left out the watch's)."""
    home = (ROOT / "docs" / "index.md").read_text()
    guides = re.findall(r"^\s+- [^:]+: ([\w-]+\.md)$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    assert "watch.md" in guides
    for guide in (g for g in guides if g != "index.md"):
        assert f"]({guide})" in home, guide


def test_the_readme_says_what_its_examples_need():
    """The quick start installs attncheck alone; the examples the README runs import transformers
    (the capture) and matplotlib (the watch's --plot): the README says how to install them."""
    text = (ROOT / "README.md").read_text()
    scripts = {cmd.split()[1] for cmd, _ in readme_commands() if cmd.startswith("python examples/")}
    needed = set()
    for script in scripts:
        source = (ROOT / script).read_text()
        needed |= {
            m for m in ("transformers", "matplotlib") if re.search(rf"^import {m}|^from {m}\b", source, flags=re.M)
        }
        needed |= {"matplotlib"} if "--plot" in source else set()
    assert needed == {"transformers", "matplotlib"}
    install = re.search(r"the examples need ([^.]*)", text.replace("\n", " "))
    assert install is not None and all(m in install.group(1) for m in needed), install
    assert "pip install transformers matplotlib" in text.replace("\n", " ")


def test_the_numerics_contract_names_tests_that_exist():
    """Each 'Tested by' of docs/reference/numerics.md names a test function of a test file."""
    import ast

    text = (ROOT / "docs" / "reference" / "numerics.md").read_text()
    cited = re.findall(r"`(tests/[\w/]+\.py)::(test_\w+)`", text)
    assert len(cited) >= 30
    for path, name in cited:
        tree = ast.parse((ROOT / path).read_text())
        assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, f"{path}::{name}"


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_doc_commands_run_in_order(doc, tmp_path):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = env_with_venv_first()
    for cmd, expected in readme_commands(doc):
        proc = subprocess.run(cmd, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == expected, (
            f"{cmd!r} exited {proc.returncode}, expected {expected}:\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}"
        )
        assert "Traceback" not in proc.stderr, cmd
