"""The built-in tool task: arithmetic with a calculator. The model may write `<calc>EXPRESSION</calc>`; its
turn ends there, the environment answers with the value as a `tool` message, and the model goes on. A
turn without a call is its final answer, judged by the math reward against the row's `answer`.

SmolLM2's chat template has no tool format of its own, so the call syntax is this module's (a tokenizer
whose template declares tools would get its own syntax through the same `step`). Expressions are
evaluated by walking their syntax tree: numbers, + - * / // % ** and parentheses only, with bounds on
length, exponents and magnitude, so no call can run code or hang the worker."""

from __future__ import annotations

import ast
import operator
import re

from everyprompt.envs.base import EnvironmentSetupError, Message, StepResult, register_environment
from everyprompt.rewards.math import math_reward

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
CALL_END = "</calc>"  # the stop string that ends a model turn at a tool call
MAX_EXPRESSION = 200  # characters
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e18

SYSTEM = (
    "You can use a calculator: write <calc>EXPRESSION</calc> (numbers, + - * / // % ** and parentheses) "
    "and its value comes back. When you know the answer, state it plainly."
)

# `example=True`: one worked exchange before the question (a small model given only the system message
# never calls the tool: SmolLM2-135M made 0 calls in 16 episodes; with this example, 3)
EXAMPLE = [
    {"role": "user", "content": "What is 12 × 13?"},
    {"role": "assistant", "content": "<calc>12*13</calc>"},
    {"role": "tool", "content": "156"},
    {"role": "assistant", "content": "12 × 13 = 156."},
]

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
# the signs people (and SmolLM2) write for these operators: 6 × 7, 8 ÷ 2, 3 − 1
_SIGNS = str.maketrans({"×": "*", "÷": "/", "−": "-"})


class CalculatorError(ValueError):
    """An expression the calculator does not take (its message goes back to the model)."""


def evaluate_expression(text: str) -> int | float:
    """The value of arithmetic expression `text`; CalculatorError for anything else."""
    text = text.strip().translate(_SIGNS)
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_EXPRESSION:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an arithmetic expression: {text!r}") from None
    value = _value(tree.body)
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError("result too large")
    return value


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent above {MAX_EXPONENT}")
        if abs(left) > MAX_MAGNITUDE or abs(right) > MAX_MAGNITUDE:
            raise CalculatorError("operand too large")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
        if isinstance(value, complex):  # a negative number to a fractional power
            raise CalculatorError("not a real number")
        return value
    raise CalculatorError(f"not allowed in an expression: {ast.unparse(node)!r}")


def format_value(value: int | float) -> str:
    """An integer as such (also a float that is one), else 10 significant digits."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.10g}"


@register_environment("calculator")
class CalculatorEnv:
    """One episode of a question with the calculator tool: at most `max_calls` calls are answered (a
    call beyond them is judged as the final answer); `example`: a worked exchange before the question."""

    stop = (CALL_END,)

    def __init__(self, max_calls: int = 4, example: bool = False):
        self.max_calls, self.example, self.calls, self.answer = max_calls, example, 0, None

    def init(self, row: dict) -> list[Message]:
        if "prompt" not in row or "answer" not in row:
            raise EnvironmentSetupError(
                f"the calculator environment needs 'prompt' and 'answer' in each data row, got {sorted(row)}"
            )
        self.answer, self.calls = str(row["answer"]), 0
        shown = EXAMPLE if self.example else []
        return [
            {"role": "system", "content": SYSTEM},
            *shown,
            {"role": "user", "content": str(row["prompt"])},
        ]

    def step(self, action: str) -> StepResult:
        call = CALL.search(action)
        if call is not None and self.calls < self.max_calls:
            self.calls += 1
            try:
                content = format_value(evaluate_expression(call.group(1)))
            except CalculatorError as err:
                content = f"error: {err}"
            return StepResult([{"role": "tool", "content": content}], metadata={"calls": self.calls})
        reward = math_reward([action], answer=[self.answer])[0]
        return StepResult([], reward=reward, done=True, metadata={"calls": self.calls})
