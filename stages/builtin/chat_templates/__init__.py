"""Chat templates shipped with align, as files a `chat_template_path` can name.

- `CHATML_TOOLS`: ChatML that renders `tools=` (JSON schemas) and assistant `tool_calls` as
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, with `tool` turns for results and
  generation markers around assistant turns. For ChatML tokenizers whose own template cannot render
  tools (SmolLM2-135M-Instruct's).
- `TINY_TOOLS`: builtin:tiny's template plus tools, listed by signature (`tools: add(a, b)`) to fit its
  512-token context; calls and results are written as in `CHATML_TOOLS`, so one parser reads both.
"""
from __future__ import annotations

from pathlib import Path

CHATML_TOOLS = Path(__file__).with_name("chatml_tools.jinja")
TINY_TOOLS = Path(__file__).with_name("tiny_tools.jinja")

__all__ = ["CHATML_TOOLS", "TINY_TOOLS"]
