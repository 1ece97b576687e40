"""Rows of text and numbers as a markdown table (the evaluate report, TensorBoard's text tab)."""
from __future__ import annotations

from typing import Any


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of `rows` (columns: the first row's keys); cells escaped so that a completion's `|` and
    line breaks keep the table whole."""
    if not rows:
        return ""
    cols = list(rows[0])

    def text(v: Any) -> str:
        if v is None:
            return ""
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(text(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)
