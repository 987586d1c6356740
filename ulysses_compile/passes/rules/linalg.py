"""Token-wise linear algebra: linear layers, matmuls against weights, embedding lookups.

A token-sharded input gives a token-sharded output; weights stay replicated (their gradients are
summed over ranks by ``sync_grad``, inserted by the redistribute pass).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ulysses_compile.core.fx_graph import method_or_function_args, normalize_dim
from ulysses_compile.core.ops import spellings
from ulysses_compile.core.sharding import PARTIAL, REPLICATE, seq_shard, with_dim
from ulysses_compile.core.sizes import size_hint
from ulysses_compile.passes.rules import Decision, register


@register(*spellings("linear"))
def linear_rule(node, view):
    args = method_or_function_args(node, ("input", "weight", "bias"))
    x = args["input"]
    factors = view.sharded(x)
    if factors is None or factors[0] == view.value(x).dim() - 1:
        return None
    demands = {x: view.placement(x), args["weight"]: REPLICATE}
    if isinstance(args.get("bias"), torch.fx.Node):
        demands[args["bias"]] = REPLICATE
    return Decision(view.placement(x), demands)


@register(*spellings("outer", "ger"))
def outer_rule(node, view):
    """``torch.outer(positions, inv_freq)`` (RoPE's angles): rows follow the first vector, columns the
    second; one of them sharded."""
    args = method_or_function_args(node, ("input", "vec2"))
    rows, columns = args["input"], args["vec2"]
    if view.sharded(rows) is not None and view.sharded(columns) is None:
        return Decision(with_dim(view.placement(rows), 0), {rows: view.placement(rows), columns: REPLICATE})
    if view.sharded(columns) is not None and view.sharded(rows) is None:
        return Decision(with_dim(view.placement(columns), 1), {rows: REPLICATE, columns: view.placement(columns)})
    return None


@register(*spellings("addmm"))
def addmm_rule(node, view):
    args = method_or_function_args(node, ("input", "mat1", "mat2"))
    rows = args["mat1"]
    factors = view.sharded(rows)
    if factors is None or factors[0] != 0:
        return None
    bias = args["input"]
    bias_value = view.value(bias)
    bias_placement = view.placement(rows) if bias_value.dim() == 2 and bias_value.shape[0] > 1 else REPLICATE
    return Decision(view.placement(rows), {rows: view.placement(rows), args["mat2"]: REPLICATE, bias: bias_placement})


@register(*spellings("matmul", "bmm", "mm"))
def matmul_rule(node, view):
    a, b = node.args[:2]
    a_value, b_value, out = view.value(a), view.value(b), view.value(node)
    a_factors, b_factors = view.sharded(a), view.sharded(b)
    if a_factors is not None and b_factors is None and a_value.dim() >= 2:
        dim = a_factors[0]
        if dim == a_value.dim() - 1:
            return None
        if b_value.dim() == 1:  # [.., S, K] @ [K] -> [.., S]
            return Decision(view.placement(a), {a: view.placement(a), b: REPLICATE})
        out_dim = dim + out.dim() - a_value.dim()
        b_dim = dim - (a_value.dim() - b_value.dim())
        if dim < a_value.dim() - 2 and b_dim >= 0 and b_value.shape[b_dim] != 1:
            b_placement = with_dim(view.placement(a), b_dim)
        else:
            b_placement = REPLICATE
        return Decision(with_dim(view.placement(a), out_dim), {a: view.placement(a), b: b_placement})
    if a_factors is not None and b_factors is not None and min(a_value.dim(), b_value.dim()) >= 3:
        # batched matmul of two operands sharded alike on the same batch dim (heads inside an attention,
        # a token's rows with its experts' weights)
        a_dim, b_dim = a_factors[0], b_factors[0]
        out_dim = a_dim + out.dim() - a_value.dim()
        if a_dim < a_value.dim() - 2 and out_dim == b_dim + out.dim() - b_value.dim() \
                and a_factors[1:] == b_factors[1:]:
            return Decision(with_dim(view.placement(a), out_dim), {a: view.placement(a), b: view.placement(b)})
    if a_factors is not None and b_factors is not None:
        return _one_operand_whole(matmul_rule, node, view, (a, b))
    if b_factors is not None and a_factors is None and b_value.dim() >= 2:
        dim = b_factors[0]
        if dim != b_value.dim() - 1:
            return None
        return Decision(with_dim(view.placement(b), out.dim() - 1), {a: REPLICATE, b: view.placement(b)})
    return None


def _one_operand_whole(rule, node, view, operands) -> Decision | None:
    """Two operands sharded on dims that do not meet (the rank's queries against every key, as a sparse
    attention's indexer scores them: ``q [B, S, H, D] @ k^T [B, 1, D, S]``): the other operand's sharding
    is given up for the smaller one (at a tie the second: the first keeps its rows, as the queries do)
    rather than both arriving whole."""
    options = []
    for index, whole in enumerate(operands):
        decision = rule(node, view.overridden({whole: REPLICATE}))
        if decision is not None:
            options.append((size_hint(view.value(whole).numel()), index == 0, decision))
    return min(options, key=lambda option: option[:2])[2] if options else None


@register(F.embedding)  # not torch.embedding: it takes (weight, indices)
def embedding_rule(node, view):
    args = method_or_function_args(node, ("input", "weight", "padding_idx", "max_norm", "norm_type",
                                          "scale_grad_by_freq", "sparse"))
    ids = args["input"]
    if view.sharded(ids) is None or args.get("max_norm") is not None or args.get("scale_grad_by_freq"):
        return None  # both look at the whole batch's ids (max_norm even rewrites the weight in place)
    return Decision(view.placement(ids), {ids: view.placement(ids), args["weight"]: REPLICATE})


@register(*spellings("index_select"))
def index_select_rule(node, view):
    """``table.index_select(dim, ids)``, a lookup as ``F.embedding`` is (XGLM's sinusoidal positions):
    the rows follow the sharded ids, the whole table on every rank."""
    args = method_or_function_args(node, ("input", "dim", "index"))
    table, ids = args["input"], args["index"]
    if view.sharded(ids) is None or view.sharded(table) is not None or view.value(ids).dim() != 1:
        return None
    return Decision(with_dim(view.placement(ids), normalize_dim(args["dim"], view.value(table).dim())),
                    {ids: view.placement(ids), table: REPLICATE})


@register(*spellings("einsum"))
def einsum_rule(node, view):
    """``einsum``: the sequence is one letter. Kept in the output, the output is sharded there; summed
    over, each rank's term is ``Partial``. Every operand with that letter must be sharded on it alike,
    and no replicated operand may have it. Two operands sharded on different letters: one arrives whole."""
    equation, *operands = node.args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if not isinstance(equation, str) or "..." in equation or "->" not in equation:
        return None
    inputs, output = equation.replace(" ", "").split("->")
    letters = inputs.split(",")
    if len(letters) != len(operands):
        return None
    sharded = {}
    for operand, subscript in zip(operands, letters):
        factors = view.sharded(operand)
        if factors is not None:
            sharded[subscript[factors[0]]] = factors[1:]
    if len(sharded) == 2 and len(operands) == 2:  # 'bsh,bth->bst': the rank's s against every t
        return _one_operand_whole(einsum_rule, node, view, operands)
    if len(sharded) != 1:
        return None
    (letter, factors), = sharded.items()
    if output.count(letter) > 1 or any(subscript.count(letter) > 1 for subscript in letters):
        return None
    demands = {}
    for operand, subscript in zip(operands, letters):
        if letter not in subscript:
            demands[operand] = REPLICATE
        elif view.sharded(operand) is None or view.sharded(operand) != (subscript.index(letter), *factors):
            return None
        else:
            demands[operand] = view.placement(operand)
    if letter not in output:
        return Decision(PARTIAL, demands)
    return Decision(seq_shard(output.index(letter), *factors), demands)


@register(torch.linalg.solve_triangular)
def solve_triangular_rule(node, view):
    """``torch.linalg.solve_triangular(A, B)``: one solve per matrix of the leading dims (gated DeltaNet's
    per chunk and head); a leading dim sharded in either operand stays sharded, the other operand read
    at the same block (or whole where it broadcasts along it)."""
    out = view.value(node)
    args = method_or_function_args(node, ("A", "B"))
    operands = (args.get("A"), args.get("B"))
    if not all(isinstance(operand, torch.fx.Node) for operand in operands):
        return None
    placements = set()
    for operand in operands:
        factors = view.sharded(operand)
        if factors is None:
            continue
        if factors[0] >= view.value(operand).dim() - 2:
            return None
        placements.add(with_dim(view.placement(operand), factors[0] + out.dim() - view.value(operand).dim()))
    if len(placements) != 1:
        return None
    (placement,) = placements
    demands = {}
    for operand in operands:
        value = view.value(operand)
        dim = placement.dim - (out.dim() - value.dim())
        demands[operand] = with_dim(placement, dim) if dim >= 0 and value.shape[dim] != 1 else REPLICATE
    return Decision(placement, demands)
