"""The command-line reference (``docs/reference/cli.md``), generated from the commands' own help
texts and options, so that it cannot drift from them. No torch: only the Typer app is read."""

from __future__ import annotations

import enum

import typer.main

from attncheck.cli import app

CLI_PAGE = "docs/reference/cli.md"
GENERATOR = "scripts/gen_docs.py"

PREAMBLE = """\
Every command prints its report on standard output and nothing on standard error but one-line
messages: a usage or input error (`attncheck: error: ...`), a `--fail-on` condition that held, a
notice (the first compile of the kernels), and, when standard error is a terminal and a run takes
longer than a second, a progress bar (`--quiet` turns notices and the bar off;
`ATTNCHECK_PROGRESS=always` draws the bar even when standard error is not a terminal).

**Exit codes.** 0: ran and nothing failed; 1: a requested check failed (`--fail-on`, or a budget of
`attncheck check`); 2: usage or input error (a missing or corrupt file, an unknown dtype, method or
code, an option that does not apply, CUDA asked for but absent, anything larger than `--max-memory`
that would be held whole, a sweep grid or synthetic inputs past `--max-work`, a closed standard output,
a `--json` FIFO that no process reads), always one line on standard error, never a traceback. A pipe
whose reader goes away (`| head -1`) ends the report quietly, with the exit code the command would
have had.

**Shared options.** `--dtype`, `--method`, `--block`, `--device`, `--scale`, `--json` and `--quiet`
mean the same in every command that takes them. `--json -` writes the JSON report to standard
output, and the tables are then not printed.

**Names from files.** Names come from files you did not write (a checkpoint's keys, someone else's
module paths), so every report prints them as text: Rich markup in a name (`[/]`, `[red]x`) stays
literal, and control characters, escape sequences, line separators and bidirectional overrides are
written as their escapes (`\\x1b`, `\\n`, `\\u202e`), in the reports, the progress bar, the one-line
errors, Markdown (as code spans) and JUnit. JSON keeps every name exactly. Every JSON attncheck reads
(a `.safetensors` header, a capture's manifest) is bounded before it is trusted: at most 64 levels
deep, no integer beyond 64 bits or number beyond float64, headers up to 100 MB and manifests up to
64 MiB.

**Findings** print as compiler diagnostics: `error[code]: what happened`, then `-->` with the tensor
or call and its first rows, then `= fix:`; see the [findings reference](findings.md), which
`attncheck explain CODE` prints one code at a time.
"""


def _cell(text: str) -> str:
    return text.replace("\\[", "[").replace("|", "\\|").replace("\n", " ")


def _value(param, ctx) -> str:
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "|".join(str(m.value) for m in annotation)
    if getattr(param, "is_flag", False):
        return ""
    return param.metavar or param.name.upper()


def _default(param) -> str:
    d = param.default
    if not getattr(param, "show_default", False) or d is None or d == "" or d == [] or d is False:
        return ""
    return str(d.value if isinstance(d, enum.Enum) else d)


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def command_section(name: str, cmd, group) -> str:
    ctx = typer.Context(cmd, info_name=name, parent=typer.Context(group, info_name="attncheck"))
    usage = " ".join(["attncheck", name, *cmd.collect_usage_pieces(ctx)])
    paragraphs = [f"`{usage}`"] + [" ".join(p.split()).replace("\\[", "[") for p in (cmd.help or "").split("\n\n")]
    lines = [f"## attncheck {name}", ""] + [line for para in paragraphs for line in (para, "")]
    args = [p for p in cmd.params if p.param_type_name == "argument"]
    if args:
        lines += ["| argument | meaning |", "| --- | --- |"]
        lines += [f"| `{p.metavar or p.name.upper()}` | {_cell(getattr(p, 'help', '') or '')} |" for p in args]
        lines.append("")
    panels: dict[str, list] = {}
    for p in cmd.params:
        if p.param_type_name == "option" and not getattr(p, "hidden", False):
            panels.setdefault(getattr(p, "rich_help_panel", None) or "Options", []).append(p)
    for panel, params in panels.items():
        if panel != "Options":
            lines += [f"### {panel}", ""]
        lines += ["| option | value | default | meaning |", "| --- | --- | --- | --- |"]
        for p in params:
            flags = ", ".join(f"`{o}`" for o in p.opts + p.secondary_opts)
            lines.append(
                f"| {flags} | {_code(_cell(_value(p, ctx)))} | {_code(_cell(_default(p)))} | {_cell(p.help or '')} |"
            )
        lines.append("")
    return "\n".join(lines)


def cli_reference() -> str:
    group = typer.main.get_command(app)
    names = list(group.commands)
    head = [
        "# Command-line reference",
        "",
        f"<!-- Generated from the commands' help texts by {GENERATOR}: edit those, not this page. -->",
        "",
        " ".join((group.help or "").split()),
        "",
        "Commands: " + ", ".join(f"[`attncheck {n}`](#attncheck-{n})" for n in names) + ".",
        "",
        PREAMBLE,
    ]
    return "\n".join(head + [command_section(n, group.commands[n], group) for n in names]).rstrip("\n") + "\n"
