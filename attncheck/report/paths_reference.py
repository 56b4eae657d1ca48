"""The attention paths section of ``docs/reference/numerics.md``, written from the paths themselves: each
path module's docstring (its rounding points), its source, what it stands for and whether its rounding
points are assumed (``registry.PATHS``). No torch; ``scripts/gen_docs.py`` writes it between the page's
markers and a test checks the committed page is what this module writes."""

from __future__ import annotations

import re

from attncheck.registry import PATHS

PAGE = "docs/reference/numerics.md"
BEGIN = "<!-- paths: written by scripts/gen_docs.py from attncheck/numerics/paths; edit the path modules -->"
END = "<!-- /paths -->"


def _stands(spec) -> str:
    out = []
    for st in spec.stands_for:
        what = st.kind + (f" {st.impl}" if st.impl else "") + (f" on {st.device}" if st.device else "")
        out.append(what + (" (where no other path takes the call)" if st.fallback else ""))
    return "; ".join(out)


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def path_section(spec) -> str:
    doc = spec.doc.strip()
    lines = [f"### {spec.name}", "", doc, ""]
    facts = []
    if spec.source:
        facts.append("- Source followed: " + _one_line(spec.source))
    if spec.stands_for:
        facts.append(f"- Judges captured calls of: {_stands(spec)}")
    if spec.assumed:
        facts.append("- Assumed, not read from a source: " + _one_line(spec.assumed))
    facts.append(
        "- In `--what-if kernels`: "
        + ("yes" + (f" ({', '.join(spec.replay_kinds)} calls)" if spec.replay_kinds else "") if spec.replay else "no")
    )
    return "\n".join(lines + facts) + "\n"


def paths_reference() -> str:
    """The generated block, markers included."""
    return BEGIN + "\n\n" + "\n".join(path_section(spec) for spec in PATHS) + "\n" + END


def with_paths(page: str) -> str:
    """``page`` with its generated block rewritten (the markers must be there)."""
    start, end = page.index(BEGIN), page.index(END) + len(END)
    return page[:start] + paths_reference() + page[end:]
