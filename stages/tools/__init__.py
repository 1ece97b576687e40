"""Tools a model calls while it generates: parsing its calls, running them, and multi-turn episodes.

- `stages.tools.calls`: a completion's tool calls in its chat template's format (`FORMATS`: "hermes",
  `<tool_call>{json}</tool_call>` as Qwen2.5, Hermes and align's CHATML_TOOLS write them; "llama3_json", Llama
  3.1's bare `{"name": ..., "parameters": ...}`), with every malformed call reported, never dropped.
- `stages.tools.runner`: running one call with a timeout, in this process (default) or in a child process;
  faults (a raising tool, a hanging one, a malformed or unknown call) become the tool's answer and are counted.
- `stages.tools.episodes`: the loop generate -> parse -> run -> append `tool` turns -> generate again, on token
  ids, with the mask that tells the model's own tokens (1) from the tool outputs and template glue (0).

Tools run with the rights of the process that runs them: in-process tools can read and write whatever the
training process can. Code a model writes belongs in `mode="subprocess"` (a forked child, killed at the
timeout), or better in a sandbox of your own behind a tool function.
"""
from __future__ import annotations

from stages.tools.calls import FORMATS, ParsedTurn, format_for_template, parse_tool_calls
from stages.tools.runner import MODES, ToolResult, ToolRunner

__all__ = ["FORMATS", "MODES", "ParsedTurn", "ToolResult", "ToolRunner", "format_for_template", "parse_tool_calls"]
