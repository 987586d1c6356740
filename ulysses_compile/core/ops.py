"""The ops the passes recognize, from one source: a family is named by its ATen op names, and every way
a Dynamo graph can call it is derived from those names.

A Dynamo graph calls an op as a function (``torch.softmax``, ``torch.special.softmax``, ``F.softmax``,
``torch._C._nn.linear``), a Tensor method (``"softmax"``; in-place ``"add_"``) or a Python operator
(``operator.add``, ``operator.iadd``). Its nodes carry no ATen tags, so the names are looked up in
those namespaces here, once. Elementwise ops are not listed at all: they are the ATen ops tagged
``pointwise`` (the tag DTensor and Inductor read), less random draws and the names with an overload that
reduces over a dim (``max(x, dim)``), plus the few elementwise ops ATen leaves untagged.
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.nn.functional as F

from ulysses_compile.core.compat import aten_overloads, native_nn_functions

_NAMESPACES = (torch, torch.special, F, native_nn_functions)

# Python operators whose ATen op has another name; the others share theirs (operator.add -> add).
_OPERATOR_RENAMES = {
    "truediv": "div", "floordiv": "floor_divide", "mod": "remainder", "and_": "bitwise_and", "or_": "bitwise_or",
    "xor": "bitwise_xor", "lshift": "bitwise_left_shift", "rshift": "bitwise_right_shift", "invert": "bitwise_not",
    "pos": "positive",
}
# Elementwise ops without ATen's pointwise tag: composites, ops their decompositions define, and ATen's
# aliases of tagged ones (``torch.multiply`` is ``mul``), as torch's JIT ``normalize_ops`` maps them.
_UNTAGGED_ELEMENTWISE = (
    "floor_divide", "polar", "hardswish", "log_sigmoid", "logsigmoid", "positive", "logical_not",
    "multiply", "divide", "subtract", "negative", "absolute", "fix", "greater", "greater_equal", "less",
    "less_equal", "not_equal", "arccos", "arcsin", "arctan", "arctan2", "arccosh", "arcsinh", "arctanh",
    "special_expit", "special_exp2", "special_psi",
)
CASTS = ("to", "type", "type_as", "float", "half", "bfloat16", "double", "int", "long", "bool")
# Ops that keep their input's layout element for element though ATen does not call them pointwise: dtype
# casts, copies and fills, called as methods.
LAYOUT_KEEPING_METHODS = (*CASTS, "contiguous", "clone", "detach", "requires_grad_", "zero_", "fill_", "copy_")


@functools.cache
def _operators() -> dict[str, tuple]:
    """ATen name -> the Python operators that call it and their Tensor methods (``add`` -> operator.add,
    ``"__add__"``; ``add_`` -> operator.iadd, ``"__iadd__"``)."""
    found: dict[str, list] = {}
    for name in dir(operator):
        base = name.rstrip("_")
        if name.startswith("_") or not hasattr(torch.Tensor, f"__{base}__"):
            continue
        aten = _OPERATOR_RENAMES.get(name, name)
        found.setdefault(aten, []).extend((getattr(operator, name), f"__{base}__"))
        if hasattr(operator, f"i{base}"):
            found.setdefault(f"{aten}_", []).extend(
                (getattr(operator, f"i{base}"), *((f"__i{base}__",) if hasattr(torch.Tensor, f"__i{base}__") else ())))
    return {name: tuple(ops) for name, ops in found.items()}


@functools.cache
def spellings(*names: str, in_place: bool = False) -> tuple:
    """Every target a Dynamo node calling the ATen ops ``names`` can have: the functions of that name in
    torch, torch.special (``special_entr`` is ``torch.special.entr``), torch.nn.functional and
    torch._C._nn, the Tensor method, the Python operators; with ``in_place``, the in-place method
    (``"add_"``) and operator (``operator.iadd``) too."""
    found: list = []
    for name in names:
        variants = (name, f"{name}_") if in_place else (name,)
        for namespace in _NAMESPACES:
            for attribute in dict.fromkeys(a for variant in variants for a in (variant, variant.removeprefix("special_"))):
                function = getattr(namespace, attribute, None)
                if callable(function) and not isinstance(function, type) and not attribute.startswith("_"):
                    found.append(function)
        found.extend(variant for variant in variants if hasattr(torch.Tensor, variant))
        found.extend(op for variant in variants for op in _operators().get(variant, ()))
    return tuple(dict.fromkeys(found))


@functools.cache
def pointwise_names() -> tuple[str, ...]:
    """The ATen ops that compute each output element from the inputs' elements at its broadcast index."""
    names = set(_UNTAGGED_ELEMENTWISE)
    for name, overloads in aten_overloads():
        tags = set().union(*(tags for tags, _, _ in overloads))
        reduces = any({"dim", "dims"} & set(arguments) for _, arguments, _ in overloads)  # max(x, dim)
        # equal's bool, frexp's pair: one tensor out of each elementwise overload, or not elementwise
        one_tensor = all(returns == ["Tensor"] for tags, _, returns in overloads if torch.Tag.pointwise in tags)
        if torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags and not reduces and one_tensor:
            names.add(name[:-1] if name.endswith("_") and not name.endswith("__") else name)
    return tuple(sorted(names))


def in_place_operators() -> frozenset:
    """The Python operators and their Tensor methods that write their first operand (``x += y``,
    ``"__iadd__"``)."""
    return frozenset(op for name, ops in _operators().items() if name.endswith("_") for op in ops)


@functools.cache
def elementwise_targets() -> frozenset:
    """:func:`elementwise` as a set, for membership tests."""
    return frozenset(elementwise())


@functools.cache
def elementwise() -> tuple:
    """Every spelling of every elementwise op, in-place ones included, and the layout-keeping methods."""
    return tuple(dict.fromkeys((*spellings(*pointwise_names(), in_place=True), *LAYOUT_KEEPING_METHODS)))
