"""The tools a request offers (`Function`) and what it asks of them (`ToolChoice`): the plain data that
the call formats (tools/parsers/) and the JSON schemas (schema.py) read. `ToolSpec` (spec.py) is a
`ToolChoice` with the model's call format: it sits above the parsers, which never see it whole."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Protocol

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
Mode = Literal["none", "auto", "required", "named"]
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class Function:
    """One tool: its name, description and the JSON Schema of its arguments (an object schema)."""

    name: str
    description: str | None
    parameters: dict[str, Any]

    def definition(self) -> dict[str, Any]:
        """The tool as chat templates and the tool prompt show it (OpenAI's shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


class ToolChoice(Protocol):
    """What a request asks of its tools: `mode` ``none`` (plain text), ``auto`` (text or calls),
    ``required`` (calls), ``named`` (one call of `functions[0]`); `parallel`: several calls allowed."""

    @property
    def functions(self) -> list[Function]: ...

    @property
    def mode(self) -> Mode: ...

    @property
    def parallel(self) -> bool: ...

    @property
    def active(self) -> bool:
        """The answer is read for tool calls: ``auto``, ``required`` or a named function, with tools."""
        ...
