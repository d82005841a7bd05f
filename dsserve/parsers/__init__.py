"""Model output parsers: reasoning, content and DSML tool calls (``output_parser``)."""

from .output_parser import (
    DIALECTS,
    CallArgs,
    CallStart,
    Delta,
    OutputParser,
    ParsedOutput,
    TextDelta,
    ToolCall,
    parse_output,
)

__all__ = [
    "DIALECTS",
    "CallArgs",
    "CallStart",
    "Delta",
    "OutputParser",
    "ParsedOutput",
    "TextDelta",
    "ToolCall",
    "parse_output",
]
