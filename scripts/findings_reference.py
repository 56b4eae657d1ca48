"""Write docs/reference/findings.md from the registry of finding codes (attncheck/codes.py).

    python scripts/findings_reference.py          # rewrite the page
    python scripts/findings_reference.py --check  # exit 1 when the page is out of date

tests/test_codes.py fails when the committed page differs from what this writes.
"""

import sys
from pathlib import Path

from attncheck.codes import REFERENCE_PAGE
from attncheck.report.reference import findings_reference

page = Path(__file__).resolve().parents[1] / REFERENCE_PAGE
text = findings_reference()
if "--check" in sys.argv[1:]:
    if not page.exists() or page.read_text() != text:
        sys.exit(f"{REFERENCE_PAGE} is out of date: run python scripts/findings_reference.py")
else:
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text)
    print(f"wrote {REFERENCE_PAGE}")
