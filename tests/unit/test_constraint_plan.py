"""Which constraint a segment decodes under (constraint_plan.py), for every engine: a forced
call wins, then a structured answer, then no call left means none, then a `strict` tool under
`auto` constrains the calls the model opens, where the engine can hold a grammar."""

from __future__ import annotations

import pytest

from proto_server.core.text_format import TextFormat
from proto_server.core.tool_choice import ToolChoice
from proto_server.engine.constraint_plan import (
    ForcedCall,
    StrictCalls,
    StructuredAnswer,
    Unconstrained,
    plan_constraint,
)
from proto_server.engine.limits import GenerationLimits, GenerationRefused
from proto_server.wire.tools import FunctionTool

EXEC = FunctionTool(name="exec", parameters={"type": "object"})
PICK = FunctionTool(name="pick", parameters={"type": "object"}, strict=True)
TOOLS = (EXEC, PICK)
FORM = TextFormat(kind="json_object")
REQUIRED = ToolChoice("required")


@pytest.mark.parametrize("guided", [True, False])
def test_a_required_call_is_forced_to_any_offered_tool(guided: bool) -> None:
    plan = plan_constraint(GenerationLimits(tool_choice=REQUIRED), TOOLS, guided=guided)
    assert plan == ForcedCall(TOOLS, None)


def test_a_named_function_is_forced_to_that_tool_alone() -> None:
    limits = GenerationLimits(tool_choice=ToolChoice("required", "exec"), max_tool_calls=2)
    assert plan_constraint(limits, TOOLS, guided=True) == ForcedCall((EXEC,), 2)


def test_a_forced_call_is_forced_even_under_a_structured_answer() -> None:
    limits = GenerationLimits(tool_choice=REQUIRED, parallel_tool_calls=False, text_format=FORM)
    assert plan_constraint(limits, TOOLS, guided=True) == ForcedCall(TOOLS, 1)


@pytest.mark.parametrize(
    ("choice", "tools"),
    [(REQUIRED, ()), (ToolChoice("required", "gone"), TOOLS)],
    ids=["nothing offered", "the named one not offered"],
)
def test_a_forced_call_with_no_tool_to_call_is_refused(
    choice: ToolChoice, tools: tuple[FunctionTool, ...]
) -> None:
    with pytest.raises(GenerationRefused) as refused:
        plan_constraint(GenerationLimits(tool_choice=choice), tools, guided=True)
    assert refused.value.code == "unsupported_tool_choice"
    assert str(refused.value) == (
        'tool_choice is "required", but the request offers no function tool to call.'
    )


def test_a_structured_answer_may_be_a_call_where_calls_are_allowed() -> None:
    limits = GenerationLimits(text_format=FORM, max_tool_calls=3)
    assert plan_constraint(limits, TOOLS, guided=True) == StructuredAnswer(FORM, TOOLS, 3)


@pytest.mark.parametrize(
    "limits",
    [
        GenerationLimits(text_format=FORM, tool_choice=ToolChoice("none")),
        GenerationLimits(text_format=FORM, tool_choice=REQUIRED, max_tool_calls=0),
        GenerationLimits(text_format=FORM, max_tool_calls=0),
    ],
    ids=["none", "required, no call left", "no call left"],
)
def test_a_structured_answer_with_no_call_left_is_the_answer_alone(
    limits: GenerationLimits,
) -> None:
    assert plan_constraint(limits, TOOLS, guided=True) == StructuredAnswer(FORM, (), 0)


def test_a_strict_tool_under_auto_constrains_the_calls_the_model_opens() -> None:
    limits = GenerationLimits(parallel_tool_calls=False)
    assert plan_constraint(limits, TOOLS, guided=True) == StrictCalls(TOOLS, 1)


@pytest.mark.parametrize(
    ("limits", "tools", "guided"),
    [
        (GenerationLimits(), (EXEC,), True),
        (GenerationLimits(), (), True),
        (GenerationLimits(), TOOLS, False),
        (GenerationLimits(tool_choice=ToolChoice("none")), TOOLS, True),
        (GenerationLimits(max_tool_calls=0), TOOLS, True),
        (GenerationLimits(tool_choice=REQUIRED, max_tool_calls=0), TOOLS, True),
    ],
    ids=[
        "no strict tool",
        "no tool",
        "no grammar to hold it",
        "none",
        "no call left",
        "required, no call left",
    ],
)
def test_otherwise_the_segment_is_unconstrained(
    limits: GenerationLimits, tools: tuple[FunctionTool, ...], guided: bool
) -> None:
    assert plan_constraint(limits, tools, guided=guided) == Unconstrained()
