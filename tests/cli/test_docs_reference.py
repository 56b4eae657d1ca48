"""The command-line reference is generated from the commands' own help texts: the committed page is
what the generator writes, and it holds every command and every option."""

from __future__ import annotations

from pathlib import Path

import typer.main

from attncheck.cli import app
from attncheck.cli.docs import CLI_PAGE, cli_reference

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_page_is_up_to_date():
    assert (ROOT / CLI_PAGE).read_text() == cli_reference(), "run: python scripts/gen_docs.py"


def test_every_command_and_option_has_its_line():
    page = cli_reference()
    group = typer.main.get_command(app)
    for name, cmd in group.commands.items():
        assert f"\n## attncheck {name}\n" in page and f"(#attncheck-{name})" in page
        section = page.split(f"\n## attncheck {name}\n")[1].split("\n## attncheck ")[0]
        for p in cmd.params:
            if p.param_type_name == "option":
                assert f"| `{p.opts[0]}`" in section, (name, p.opts)
    run = page.split("\n## attncheck run\n")[1]
    assert "| `--order` | `forward\\|reverse` | `forward` | Order in which the tiled method visits key blocks. |" in run
    assert (
        "| `--brief` |  |  | Leave out the per-cell detail table of per-tensor reports (one tensor, --detail, "
        "--full); --summary is the short answer. |" in run
    )
    assert "| `--summary` |  |  | The short answer on one screen instead of the report:" in run
    assert "\n### Q/K inputs\n" in run and "\n### FP8 attention\n" in run
