"""``clover serve``: tool calling. The request's tools and tool_choice, validated by the pydantic
types, go to the runtime's :mod:`clover_cpp.tool_calls` (the prompt's tools and prefill, a forced
call's grammar, the reply's calls parsed out of its text); its errors become 400s."""

from __future__ import annotations

from ..errors import CloverError
from ..tool_calls import ToolPlan, ToolStream, reply_message
from ..tool_calls import plan as runtime_plan
from .types import APIError, NamedChoice, Tool

__all__ = ["ToolPlan", "ToolStream", "plan", "reply_message"]


def plan(tools: list[Tool] | None, choice: str | NamedChoice | None, parallel: bool,
         template: str | None, reasoning_format: str = "none") -> ToolPlan:
    """The request's tool plan (see :func:`clover_cpp.tool_calls.plan`); bad input: a 400."""
    dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    named = choice.model_dump() if isinstance(choice, NamedChoice) else choice
    try:
        return runtime_plan(dicts, named, parallel, template, reasoning_format)
    except CloverError as e:
        raise APIError(400, e.message, param=e.param) from None
