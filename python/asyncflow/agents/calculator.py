"""Safe arithmetic for the ``calculator`` tool: the expression is parsed with :mod:`ast` and only
numbers, ``+ - * / // % **`` and parentheses are evaluated (never ``eval``), with bounds on
exponents and on the size of intermediate results so no expression can exhaust the machine."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

Number = int | float

MAX_LENGTH = 1000
MAX_EXPONENT = 1000
#: Digits an intermediate integer may have.
MAX_DIGITS = 4000

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or cannot be computed (the message says why)."""


#: Bits an intermediate integer may have.
MAX_BITS = int(MAX_DIGITS * 3.33)


def _check_size(value: Number) -> Number:
    if isinstance(value, complex):  # a negative number to a fractional power
        raise CalculatorError("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise CalculatorError("result too large")
    return value


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check_size(node.value)  # type: ignore[arg-type]  # (checked just above)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check_size(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if abs(right) > MAX_EXPONENT:
                raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
            # Refused before computing: a large base to a large power takes seconds of CPU.
            if (
                isinstance(left, int)
                and isinstance(right, int)
                and (left.bit_length() - 1) * right > MAX_BITS
            ):
                raise CalculatorError("result too large")
        try:
            return _check_size(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
    raise CalculatorError(f"not allowed in an expression: {ast.dump(node)[:60]}")


def evaluate(expression: str) -> Number:
    """The value of an arithmetic ``expression``; raises :class:`CalculatorError`."""
    if len(expression) > MAX_LENGTH:
        raise CalculatorError(f"expression longer than {MAX_LENGTH} characters")
    try:
        return _eval(ast.parse(expression.strip(), mode="eval"))
    except SyntaxError as e:
        raise CalculatorError(f"cannot parse {expression!r}: {e.msg}") from None
    except RecursionError:  # e.g. a thousand signs in a row, parsed or evaluated
        raise CalculatorError("expression nested too deeply") from None


def format_number(value: Number) -> str:
    """Integers as integers (``6.0`` -> ``6``); other floats as Python writes them."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return str(value)
