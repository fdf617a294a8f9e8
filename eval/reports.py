"""Where the evaluation scripts write their results: OUT.md (header and table) and OUT.json (header and rows)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(out: Path, header: str, table: list[str], rows: list[dict[str, Any]]) -> None:
    """Write OUT.md and OUT.json next to each other and print the Markdown."""
    text = "\n".join([header, "", *table]) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.md").write_text(text)
    Path(f"{out}.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    print(text, end="")
