"""A calculator tool: ``+ - * /``, parentheses and unary signs on numbers, evaluated from the
syntax tree (``ast``), never with ``eval``.

    tools:
      - function: distflow.multiturn.tools.calculator:calculate
        toolSchema: {type: function, function: {name: calculate, ...}}   # SCHEMA below
"""

from __future__ import annotations

import ast
import operator

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 1e15
"""Larger intermediate values are refused: a model cannot make the worker compute 9**9**9."""

SCHEMA = {"type": "function", "function": {
    "name": "calculate",
    "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
    "parameters": {"type": "object",
                   "properties": {"expression": {"type": "string", "description": "e.g. (12 + 5) * 3"}},
                   "required": ["expression"]}}}
"""The tool in the OpenAI format, as a spec's ``toolSchema`` gives it."""


def calculate(expression: str) -> str:
    """The value of ``expression`` as text (``17``, ``2.5``), or ``error: ...`` for what it cannot
    evaluate (other syntax, division by zero, a value beyond 1e15): an answer the model reads."""
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
        return f"error: give the expression as a string of at most {MAX_EXPRESSION_CHARS} characters"
    try:
        value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    except SyntaxError:
        return f"error: {expression!r} is not an arithmetic expression"
    except (ValueError, ZeroDivisionError) as err:
        return f"error: {err}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        value = _BINARY[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_evaluate(node.operand))
    else:
        raise ValueError(f"only numbers, + - * / and parentheses are allowed, not {type(node).__name__}")
    if abs(value) > MAX_MAGNITUDE:
        raise ValueError(f"a value beyond {MAX_MAGNITUDE:g}")
    return value
