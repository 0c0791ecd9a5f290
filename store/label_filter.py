"""Label expressions such as ``role == "answer" and 1 <= pos < 64``, parsed safely (no eval).

Allowed: label names, string and number literals, lists or tuples of them, comparisons
(``== != < <= > >= in not in``, chained), ``and``, ``or``, ``not`` and parentheses.
"""
from __future__ import annotations

import ast
import operator

import numpy as np

COMPARISONS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
               ast.Gt: operator.gt, ast.GtE: operator.ge}


class LabelExpression:
    """A parsed label expression: `names` it reads, and `mask(labels)` of the tokens it selects."""

    def __init__(self, text: str, available):
        try:
            self.tree = ast.parse(text, mode="eval").body
        except SyntaxError as error:
            raise ValueError(f"where={text!r} is not a label expression: {error.msg}") from None
        self.text = text
        self._check(self.tree)
        self.names = sorted({node.id for node in ast.walk(self.tree) if isinstance(node, ast.Name)})
        unknown = [name for name in self.names if name not in available]
        if unknown:
            raise ValueError(f"where={text!r} names {', '.join(map(repr, unknown))}, which the store does not hold; "
                             f"its labels are {', '.join(sorted(available))}")

    def _check(self, node) -> None:
        if isinstance(node, ast.BoolOp | ast.Compare | ast.Name | ast.Constant | ast.List | ast.Tuple):
            for child in ast.iter_child_nodes(node):
                if not isinstance(child, ast.cmpop | ast.boolop | ast.expr_context):
                    self._check(child)
            if isinstance(node, ast.Compare) and not all(type(op) in COMPARISONS or isinstance(op, ast.In | ast.NotIn)
                                                         for op in node.ops):
                raise ValueError(f"where={self.text!r}: only == != < <= > >= in and not in compare labels")
            if isinstance(node, ast.Constant) and not isinstance(node.value, str | int | float):
                raise ValueError(f"where={self.text!r}: {node.value!r} is not a string or number")
            return
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            self._check(node.operand)
            return
        raise ValueError(f"where={self.text!r}: {ast.unparse(node)!r} is not allowed (only labels, literals, "
                         "comparisons, and, or, not)")

    def mask(self, labels: dict[str, np.ndarray]) -> np.ndarray:
        """The tokens the expression selects, given each named label's values."""
        return np.asarray(self._value(self.tree, labels), dtype=bool)

    def _value(self, node, labels):
        if isinstance(node, ast.Name):
            return labels[node.id]
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.List | ast.Tuple):
            return [self._value(element, labels) for element in node.elts]
        if isinstance(node, ast.UnaryOp):
            return ~np.asarray(self._value(node.operand, labels), dtype=bool)
        if isinstance(node, ast.BoolOp):
            values = [np.asarray(self._value(value, labels), dtype=bool) for value in node.values]
            combine = np.logical_and if isinstance(node.op, ast.And) else np.logical_or
            return combine.reduce(values)
        left, result = self._value(node.left, labels), True
        for op, comparator in zip(node.ops, node.comparators):
            right = self._value(comparator, labels)
            if {_kind(left), _kind(right)} == {"text", "number"}:
                raise ValueError(f"where={self.text!r}: compares text with a number, which selects no token; "
                                 "quote a text label's values (role == 'digit') and leave a number label's bare")
            if isinstance(op, ast.In | ast.NotIn):
                found = np.isin(left, right)
                step = found if isinstance(op, ast.In) else ~found
            else:
                step = COMPARISONS[type(op)](left, right)
            result = np.logical_and(result, step)
            left = right
        return result


def _kind(value) -> str | None:
    """Whether a label's values or a literal are "text" or a "number" (None: a list mixing them, or empty)."""
    if isinstance(value, list):
        kinds = {_kind(item) for item in value}
        return kinds.pop() if len(kinds) == 1 else None
    if isinstance(value, np.ndarray):
        return "text" if value.dtype.kind in "USOT" else "number"
    return "text" if isinstance(value, str) else "number"
