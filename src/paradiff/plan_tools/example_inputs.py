"""The one materializer of the families' `INPUTS` declarations (records in `plans/inputs.py`).

Every random tensor is drawn from the caller's generator in declaration order, depth first, so a declaration and a
seed fix the inputs. Expressions are evaluated by a small interpreter over Python's own syntax tree: names,
arithmetic, comparisons, conditionals, subscripts and a few built-ins; nothing is `eval`ed.
"""

from __future__ import annotations

import ast
import importlib
import operator
from collections import ChainMap
from dataclasses import dataclass
from typing import Any

import torch

from paradiff.errors import PlanError
from paradiff.plans import inputs as spec
from paradiff.plans.common import Grid

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not}
_FUNCTIONS = {"len": len, "sum": sum, "max": max, "min": min, "int": int, "float": float, "tuple": tuple,
              "list": list}


@dataclass(frozen=True)
class _Scope:
    """What an expression's names mean: the example, the batch, the grid, the config, a sample's index."""

    name: str
    config: Any
    batch: int
    grid: Grid
    generator: torch.Generator
    index: int | None = None

    def lookup(self, name: str, expression: str) -> Any:
        if name == "batch":
            return self.batch
        if name == "name":
            return self.name
        if name == "config":  # the whole config, for a Call that builds from it
            return self.config
        if name == "index" and self.index is not None:
            return self.index
        if name in ("frames", "height", "width", "text"):
            return getattr(self.grid, name)
        config = self.config
        if isinstance(config, dict) and name in config:
            return config[name]
        if not isinstance(config, dict) and hasattr(config, name):
            return getattr(config, name)
        raise PlanError(f"example input expression {expression!r} names {name!r}, which is neither batch, name, "
                        f"config, index, a grid size (frames, height, width, text) nor a field of the {self.name!r} "
                        "config.")

    def evaluate(self, expression: Any) -> Any:
        """An int / float passes; a string is parsed and evaluated."""
        if not isinstance(expression, str):
            return expression
        try:
            tree = ast.parse(expression, mode="eval")
        except SyntaxError as error:
            raise PlanError(f"example input expression {expression!r} is not a Python expression: {error.msg}.")
        return self._node(tree.body, expression)

    def index_tuple(self, index: str) -> Any:
        """A numpy-style index ("-1, text // 2:") as the tuple / slice / int `tensor[...]` takes."""
        tree = ast.parse(f"_[{index}]", mode="eval")
        return self._node(tree.body.slice, index)

    def _node(self, node: ast.AST, expression: str) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return self.lookup(node.id, expression)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](self._node(node.left, expression), self._node(node.right, expression))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._node(node.operand, expression))
        if isinstance(node, ast.BoolOp):  # Python's own: the first value deciding the outcome, or the last
            for value_node in node.values[:-1]:
                value = self._node(value_node, expression)
                if bool(value) != isinstance(node.op, ast.And):
                    return value
            return self._node(node.values[-1], expression)
        if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
            left = self._node(node.left, expression)
            for op, right_node in zip(node.ops, node.comparators):
                right = self._node(right_node, expression)
                if not _COMPARE[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.IfExp):
            test = self._node(node.test, expression)
            return self._node(node.body if test else node.orelse, expression)
        if isinstance(node, ast.Subscript):
            return self._node(node.value, expression)[self._node(node.slice, expression)]
        if isinstance(node, ast.Slice):
            parts = (node.lower, node.upper, node.step)
            return slice(*(None if part is None else self._node(part, expression) for part in parts))
        if isinstance(node, (ast.Tuple, ast.List)):
            items = [self._node(item, expression) for item in node.elts]
            return items if isinstance(node, ast.List) else tuple(items)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "field"
                and len(node.args) == 2 and not node.keywords):
            name, default = (self._node(arg, expression) for arg in node.args)
            config = self.config
            return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
                and not node.keywords):
            return _FUNCTIONS[node.func.id](*(self._node(arg, expression) for arg in node.args))
        raise PlanError(f"example input expression {expression!r}: {ast.unparse(node)!r} is not allowed (names, "
                        f"numbers, arithmetic, comparisons, `a if c else b`, subscripts, field(name, default), {sorted(_FUNCTIONS)}).")

    def shape(self, dims: tuple) -> tuple[int, ...]:
        return tuple(int(self.evaluate(dim)) for dim in dims)


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise PlanError(f"example input dtype {name!r} is no torch dtype (e.g. 'bool', 'long', 'float32').")
    return dtype


def _set(tensor: torch.Tensor, sets: tuple, scope: _Scope) -> torch.Tensor:
    for index, value in sets:
        tensor[scope.index_tuple(index)] = scope.evaluate(value)
    return tensor


_LEFT_OUT = object()  # a `When` whose condition does not hold: its key is left out


def _make(item: Any, scope: _Scope, done: dict) -> Any:
    generator = scope.generator
    if isinstance(item, spec.Noise):
        return torch.randn(scope.shape(item.shape), generator=generator)
    if isinstance(item, spec.Uniform):
        drawn = torch.rand(scope.shape(item.shape), generator=generator) * item.scale
        if item.expand is not None:
            drawn = drawn.expand(scope.shape(item.expand)).clone()
        return _set(drawn, item.set, scope)
    if isinstance(item, spec.Integers):
        drawn = torch.randint(int(scope.evaluate(item.low)), int(scope.evaluate(item.high)), scope.shape(item.shape),
                              generator=generator)
        return _set(drawn, item.set, scope)
    if isinstance(item, spec.Full):
        full = torch.full(scope.shape(item.shape), scope.evaluate(item.value), dtype=_dtype(item.dtype))
        return _set(full, item.set, scope)
    if isinstance(item, spec.Tensor):
        values = _values(item.values, scope)
        tensor = torch.tensor([values] * scope.batch if item.per_sample else values, dtype=_dtype(item.dtype))
        return tensor
    if isinstance(item, spec.Arange):
        values = torch.arange(int(scope.evaluate(item.start)), int(scope.evaluate(item.stop)))
        return values.expand(scope.batch, -1).clone() if item.per_sample else values
    if isinstance(item, spec.GridIds):
        rows, cols, axes = (int(scope.evaluate(dim)) for dim in (item.rows, item.cols, item.axes))
        ids = torch.zeros(rows * cols, axes)
        for column, value in item.fixed.items():
            ids[:, column] = value
        ids[:, -2] = torch.arange(rows).repeat_interleave(cols)
        ids[:, -1] = torch.arange(cols).repeat(rows)
        return ids
    if isinstance(item, spec.GridPositions):
        sizes = scope.shape(item.sizes)
        axes = torch.meshgrid(*(torch.arange(size) for size in sizes), indexing="ij")
        positions = torch.stack([axis.flatten() for axis in axes])
        if item.scale is not None:
            positions = positions * torch.tensor(item.scale).view(-1, 1)
        if item.offset is not None:
            positions = positions + torch.tensor(_values(item.offset, scope)).view(-1, 1)
        if item.points_first:
            positions = positions.transpose(0, 1).contiguous()
        return positions.expand(scope.batch, *positions.shape).clone() if item.per_sample else positions
    if isinstance(item, spec.Cat):
        joined = torch.cat([_make(part, scope, done) for part in item.parts], dim=item.dim)
        return joined.expand(scope.batch, *joined.shape).clone() if item.per_sample else joined
    if isinstance(item, spec.Value):
        return scope.evaluate(item.expression)
    if isinstance(item, spec.Repeat):
        return [_make(item.item, scope, done) for _ in range(int(scope.evaluate(item.count)))]
    if isinstance(item, spec.PerSample):
        return [_make(item.item, _with_index(scope, index), done) for index in range(scope.batch)]
    if isinstance(item, spec.When):
        return _make(item.item, scope, done) if scope.evaluate(item.condition) else _LEFT_OUT
    if isinstance(item, spec.Ref):
        first, *rest = item.key.split(".")
        value = done.get(first)
        for part in rest:
            value = value.get(part) if isinstance(value, dict) else None
        if value is None:
            raise PlanError(f"example input Ref({item.key!r}) names no input declared before it; "
                            f"declared so far: {sorted(done)}.")
        scale = _make(item.scale, scope, done)
        return value if isinstance(scale, (int, float)) and scale == 1 else value * scale
    if isinstance(item, spec.Call):
        function = _function(item.function)
        return function(*_make(tuple(item.args), scope, done), **_make(dict(item.kwargs), scope, done))
    if isinstance(item, spec.ByExample):
        raise PlanError("ByExample may only be a family's whole INPUTS declaration, not one input of it.")
    if isinstance(item, dict):
        made: dict = {}
        visible = ChainMap(made, done)  # this dict's inputs so far, then those of the dicts around it
        for key, value in item.items():
            value = _make(value, scope, visible)
            if value is not _LEFT_OUT:
                made[key] = value
        return made
    if isinstance(item, (list, tuple)):
        return type(item)(_make(value, scope, done) for value in item)
    return item


def _function(path: str) -> Any:
    module_name, _, name = path.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), name) if name else None
    except ImportError as error:
        raise PlanError(f"example input Call({path!r}): cannot import {module_name!r} ({error}).") from None
    if not callable(function):
        raise PlanError(f"example input Call({path!r}) names no function; write 'module:function'.")
    return function


def _values(values: Any, scope: _Scope) -> Any:
    if isinstance(values, (list, tuple)):
        return [_values(value, scope) for value in values]
    return scope.evaluate(values)


def _with_index(scope: _Scope, index: int) -> _Scope:
    return _Scope(scope.name, scope.config, scope.batch, scope.grid, scope.generator, index)


def materialize(declaration: Any, name: str, config: Any, batch: int, grid: Grid,
                generator: torch.Generator) -> dict:
    """The forward keywords the family's `INPUTS` declaration gives example `name` with this config, batch and grid,
    every random tensor drawn from `generator` in declaration order."""
    if isinstance(declaration, spec.ByExample):
        if name not in declaration.examples:
            raise PlanError(f"no example inputs declared for example {name!r}; declared: "
                            f"{sorted(declaration.examples)}.")
        declaration = declaration.examples[name]
    if not isinstance(declaration, dict):
        raise PlanError(f"a family's INPUTS must be a dict of forward keywords or ByExample, not "
                        f"{type(declaration).__name__}.")
    return _make(declaration, _Scope(name, config, batch, grid, generator), {})
