"""Write the generated reference pages: docs/reference/findings.md from the registry of finding
codes (attncheck/findings/: each group module's entries, in registry.ORDER), docs/reference/cli.md
from the commands' own help texts, and the attention paths section of docs/reference/numerics.md
from the path modules (attncheck/numerics/paths).

    python scripts/gen_docs.py          # rewrite the pages
    python scripts/gen_docs.py --check  # exit 1 when a page is out of date

tests/report/test_reference.py and tests/cli/test_docs_reference.py fail when a committed page
differs from what this writes.
"""

import sys
from pathlib import Path

from attncheck.cli.docs import CLI_PAGE, cli_reference
from attncheck.codes import REFERENCE_PAGE
from attncheck.report.paths_reference import PAGE as NUMERICS_PAGE
from attncheck.report.paths_reference import with_paths
from attncheck.report.reference import findings_reference

ROOT = Path(__file__).resolve().parents[1]
# the numerics page is hand-written but for its attention paths section, written from the path modules
PAGES = {
    REFERENCE_PAGE: findings_reference,
    CLI_PAGE: cli_reference,
    NUMERICS_PAGE: lambda: with_paths((ROOT / NUMERICS_PAGE).read_text()),
}

stale = []
for name, make in PAGES.items():
    page, text = ROOT / name, make()
    if "--check" in sys.argv[1:]:
        if not page.exists() or page.read_text() != text:
            stale.append(name)
    else:
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(text)
        print(f"wrote {name}")
if stale:
    sys.exit(f"out of date: {', '.join(stale)}; run python scripts/gen_docs.py")
