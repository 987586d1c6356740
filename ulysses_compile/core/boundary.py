"""Where a compiled graph's outputs meet the user's code: a sequence-sharded output leaves the graph as
the rank's block and reaches the caller gathered only when read (the default, ``outputs="lazy"``), or as
a DTensor (``outputs="dtensor"``).

The graph's outputs and what the caller gets, for a model called with labels::

    return (loss, logits_block)             # the rewritten graph: logits_block is [B, S/P, V]
    (loss, GatheredOnUse(logits_block))     # lazy: a [B, S, V] tensor, its value eager's
    (loss, DTensor(logits_block, Shard(1))) # dtensor: a [B, S, V] DTensor over the "sp" mesh

``GatheredOnUse`` reads as the plain tensor eager returns: the first op that reads it (any op but
``detach``) gathers the whole from every rank and keeps it; the gradient that reaches it goes back to
the rank's block as ``gather_seq``'s does. A loop that trains on ``.loss`` never gathers the ``[S, V]``
logits, and one that reads them gets eager's tensor. The gather is a collective: every rank must read
the same outputs in the same order (an ``if rank == 0:`` around a read leaves the other ranks out of it).
Each first read starts with a small all-gather naming the output read (which call of a graph with lazy
outputs, which output), so ranks reading different outputs stop with a ``CollectiveError`` rather than
mix them up; a rank that never reads leaves the others waiting for the process group's timeout, then
failing. Ops that would change its shape in place (``transpose_``, ``out=``) are refused.

The same holds for a value crossing a graph break: the Python between the graphs runs alike on every
rank, reads it gathered, and hands it to the next graph, which takes the rank's block (``own_block``)
and runs on it, with attention or without (``PassContext.lazy_inputs``).

A ``DTensor`` keeps DTensor's semantics, not eager's (docs/how-it-works.md, "Outputs"), so it is an
option, for outputs that go straight to the ``torch.compile`` caller (``backend.returns_to_compile_caller``);
a value crossing a graph break is then gathered inside the graph, as are outputs the caller could not be
given: a DTensor's ``Shard`` holds ``torch.chunk``'s blocks and no placement describes merged dims
(``[B*S, V]``), and a lazy output of a graph compiled for every length needs P to divide the length to
know it.
"""

from __future__ import annotations

import copy
import functools
import itertools
import weakref
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard as DTensorShard
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ulysses_compile.core.collectives import gather_blocks, gather_rows, take_block
from ulysses_compile.core.compat import (
    disabled_torch_function,
    is_fake,
    make_wrapper_subclass,
    statically_known_true,
    symbolic_hint,
    tree_map,
    version_counter,
)
from ulysses_compile.core.errors import CollectiveError, UnsupportedError, is_collective_failure
from ulysses_compile.core.sharding import block_range
from ulysses_compile.core.sizes import is_symbolic


@dataclass(frozen=True)
class SequenceBlocks:
    """How an output leaves the graph: its dim ``dim`` read as ``[outer, S, inner]``, the sequence S in
    the ranks' balanced blocks (or the head-tail layout's, ``collectives.head_tail_positions``).
    ``length`` is S for a graph compiled for one length, None for one compiled for every length (then
    P divides S, ``even_blocks``)."""

    dim: int
    outer: int
    inner: int
    length: int | None
    head_tail: int = 0  # the ring's size where the ranks hold the sequence in the head-tail layout

    def whole_length(self, block: torch.Tensor, world_size: int) -> int:
        if self.length is not None:
            return self.length
        return block.shape[self.dim] // (self.outer * self.inner) * world_size


def even_blocks(length, world_size: int) -> bool:
    """Whether P divides the length for every call of the graph (a symbolic length's remainder mod P is
    pinned by its class guard, ``sizes.pin_length_class``)."""
    if not is_symbolic(length):
        return length % world_size == 0
    return statically_known_true(length % world_size == 0)


@dataclass(frozen=True)
class _Layout:
    dim: int
    outer: int
    inner: int
    rank: int
    world_size: int
    group_name: str
    head_tail: int = 0


@dataclass(frozen=True)
class _Read:
    """Which output a first read gathers, named alike on every rank: the graph (a digest of the program
    every rank compiled, and the grad mode of the call: Dynamo compiles a graph again for ``no_grad``,
    with the same digest), its call (a graph's calls are collective, so every rank counts them alike, and
    a count kept per graph is untouched by what the ranks did with other graphs) and the output. Two
    compiled graphs of one program in one grad mode (the same model compiled twice) count apart: reads
    of their outputs in different orders on different ranks are not told apart."""

    name: str  # "output 1 of compiled graph 0/0"
    graph: int
    grad: bool
    call: int  # of this graph, from 1
    position: int

    def row(self) -> list[int]:
        return [self.graph, int(self.grad), self.call, self.position]

    def describe(self, row: list[int]) -> str:
        graph, grad, call, position = row
        same = (graph, grad) == (self.graph, int(self.grad))
        return f"output {position} of call {call} of " + ("this graph" if same else
                                                          f"another graph ({'grad' if grad else 'no_grad'})")


@dataclass(frozen=True)
class WeightChain:
    """The ops by which a graph made the LM head's weight from one of its inputs (``sync_grad``,
    ``average_grad``, ZeRO's ``gather_parameter``), each ``(op, target, args after the first, kwargs)``:
    replayed outside the graph when logits it left out are read, so that the graph returns the input
    itself (``ulysses_compile/passes/return_weight_inputs.py``). Forward, the weight the graph computed; backward, the
    gradient reductions the graph would have run."""

    steps: tuple = ()

    def __call__(self, source: torch.Tensor) -> torch.Tensor:
        value = source
        for op, target, args, kwargs in self.steps:
            value = getattr(value, target)(*args, **dict(kwargs)) if op == "call_method" \
                else target(value, *args, **dict(kwargs))
        return value


@dataclass(frozen=True)
class LazyLinear:
    """An output a graph left out: ``linear(output, chain(the output at position weight))``, ``vocab`` wide."""

    weight: int
    vocab: int
    chain: WeightChain = WeightChain()


@dataclass(eq=False)
class LinearRows:
    """A block not computed yet: ``linear(rows, chain(source))``, the LM head's logits a tiled loss left
    out of the graph (``ulysses_compile/passes/tile_token_loss.py``), computed when read from the hidden states the loss
    keeps for its backward anyway. ``version`` is the weight's source's in-place write count when the
    graph ran; ``stepped``: an optimizer has stepped it since (writes outside autograd's counter)."""

    rows: torch.Tensor
    source: torch.Tensor
    chain: WeightChain
    version: int
    name: str
    vocab: int
    stepped: bool = False

    def __post_init__(self):
        _watch_optimizer_steps()
        _UNREAD.add(self)

    @property
    def shape(self) -> tuple:
        return (*self.rows.shape[:-1], self.vocab)

    def written(self) -> bool:
        """Whether the weight's source was written since the graph ran, as this rank sees it (a ZeRO
        shard padded to equal blocks is a copy, which the optimizer does not write)."""
        return self.stepped or version_counter(self.source) != self.version

    def refuse_stale(self, written: bool) -> None:
        if written:
            raise UnsupportedError(
                f"the {self.name} (the logits of a model whose loss runs tiled) are computed when first read, "
                f"from the LM head's weight, and that weight was written since the model ran "
                f"(optimizer.step()); read the logits before the optimizer step (logits = out.logits.clone()), "
                f"or compile with options={{'outputs': 'gather'}}"
            )

    def block(self) -> torch.Tensor:
        _UNREAD.discard(self)
        with torch.no_grad(), torch.autocast(self.rows.device.type, enabled=False):
            return torch.nn.functional.linear(self.rows, self.chain(self.source))


_UNREAD: weakref.WeakSet = weakref.WeakSet()


@functools.cache
def _watch_optimizer_steps():
    """Optimizers whose kernels write parameters without counting the write (fused and 8-bit Adams,
    ``p.data`` updates): a step marks the unread logits over a stepped weight."""
    return register_optimizer_step_pre_hook(_mark_stepped)


def _mark_stepped(optimizer, args, kwargs) -> None:
    if not _UNREAD:
        return
    stepped = {_local(parameter).untyped_storage().data_ptr() for group in optimizer.param_groups
               for parameter in group["params"]}
    for unread in list(_UNREAD):
        if unread.source.untyped_storage().data_ptr() in stepped:
            unread.stepped = True


def _local(parameter: torch.Tensor) -> torch.Tensor:
    """A parameter's storage on this rank (a ZeRO shard's rows)."""
    return parameter.to_local() if isinstance(parameter, DTensor) else parameter


class GatheredOnUse(torch.Tensor):
    """A sequence-sharded graph output with eager's value and shape, holding this rank's block until an
    op reads it; then the whole, gathered from every rank once and kept (shared with its ``detach``-es)."""

    __torch_function__ = disabled_torch_function

    @staticmethod
    def __new__(cls, block, whole, layout: _Layout, length, read: _Read | None, kept: list):
        like = whole if block is None else block.rows if isinstance(block, LinearRows) else block
        shape = list(whole.shape if block is None else block.shape)
        shape[layout.dim] = layout.outer * length * layout.inner
        tensor = make_wrapper_subclass(cls, shape, like)
        tensor._source, tensor._layout, tensor._read, tensor._kept = block, layout, read, kept
        if whole is not None and not kept:
            kept.append(whole)
        return tensor

    def __init__(self, block, whole, layout, length, read, kept):
        super().__init__()

    @property
    def _block(self) -> torch.Tensor:
        """This rank's block; a ``LinearRows`` computed now, once the ranks agree on the read (its weight
        may be gathered, and written since on some ranks)."""
        if not isinstance(self._source, LinearRows):
            return self._source
        if not is_fake(self._source.rows):
            self._source.refuse_stale(_agree_on_read(self._read, self._layout, self.device, self._source.written()))
        return self._source.block()

    @property
    def _length(self):
        """The sequence's length S (its dim is ``[outer, S, inner]``)."""
        return self.shape[self._layout.dim] // (self._layout.outer * self._layout.inner)

    def own_block(self, dim, outer, inner, rank, world_size, group_name, head_tail=0) -> torch.Tensor | None:
        """This rank's block, when ``scatter_seq`` takes the block the graph that made it returned (same
        layout, rank and group) from a whole not gathered yet (nor gathered in the graph being traced,
        which may have written into it): the block itself, no gather. Else None."""
        layout = self._layout
        # A rank read at run time is this process's rank in the group: the layout's where the group is.
        same = (dim, outer, inner, world_size, group_name, head_tail) == \
            (layout.dim, layout.outer, layout.inner, layout.world_size, layout.group_name, layout.head_tail) and \
            (isinstance(rank, torch.Tensor) or rank == layout.rank)
        if not same or self._kept or getattr(self, "_traced", None) is not None:
            return None
        block = self._block
        size = outer * block_range(self._length, world_size, rank)[1] * inner
        if is_symbolic(size) or is_symbolic(block.shape[dim]):
            # traced for every length: the block's size is a symbol of its own, the whole's another. A
            # graph producing blocks of a symbolic length makes them even (``even_blocks``): so taken,
            # this graph serves even lengths (a guard), and another is compiled for odd ones.
            hint = symbolic_hint(self._length) if is_symbolic(self._length) else None
            if hint is None or hint % world_size:
                return None
            torch._check(self._length % world_size == 0)
            torch._check(block.shape[dim] == size)
            if not statically_known_true(block.shape[dim] == size):
                return None
        return block

    def lazy_whole_of(self):
        """A function from blocks laid out as this one's to their whole, gathered when read (a gradient's
        way back)."""
        return functools.partial(_lazy_whole, layout=self._layout, length=self._length)

    @property
    def gathered(self) -> bool:
        """Whether an op has read it (so this rank holds the whole)."""
        return bool(self._kept)

    def whole(self) -> torch.Tensor:
        """The tensor eager returns (gathered at the first call on any rank, all ranks together). Traced
        into a graph, the gather is the graph's, made once per traced tensor."""
        if self._kept:
            return self._kept[0]
        if is_fake(self._source):  # traced into a graph, which every rank runs alike
            if getattr(self, "_traced", None) is None:
                self._traced = _gather(self._block, self._layout, self._length)
            return self._traced
        if not isinstance(self._source, LinearRows):  # (its block agrees on the read itself)
            _agree_on_read(self._read, self._layout, self.device, written=False)
        self._kept.append(_gather(self._block, self._layout, self._length))
        return self._kept[0]

    def __repr__(self, *, tensor_contents=None):
        return repr(self.whole())

    def tolist(self):
        return self.whole().tolist()

    def numpy(self, *, force: bool = False):
        return self.whole().numpy(force=force)

    def __dlpack__(self, *args, **kwargs):
        return self.whole().__dlpack__(*args, **kwargs)

    def __reduce_ex__(self, protocol):
        return self.whole().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return copy.deepcopy(self.whole(), memo)

    def __tensor_flatten__(self):
        if self._kept:
            return ["_whole_kept"], (self._layout, True)
        return ["_block"], (self._layout, False)

    @property
    def _whole_kept(self) -> torch.Tensor:
        return self._kept[0]

    @staticmethod
    def __tensor_unflatten__(inner, context, outer_size, outer_stride):
        layout, gathered = context
        length = outer_size[layout.dim] // (layout.outer * layout.inner)
        if gathered:
            return GatheredOnUse(None, inner["_whole_kept"], layout, length, None, [])
        return GatheredOnUse(inner["_block"], None, layout, length, None, [])

    @classmethod
    @torch.compiler.disable  # eager code between graphs calls it: Dynamo would compile it as a frame
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = args[0] if args else None
        if func in _KEEPS_BLOCK and isinstance(source, cls) and not source._kept:
            block = source._source if isinstance(source._source, LinearRows) else func(source._source)
            return cls(block, None, source._layout, source._length, source._read, source._kept)
        _refuse_reshaping_writes(func, args, kwargs)
        _refuse_traced_writes(func, source)
        result = func(*tree_map(_whole_of, args), **tree_map(_whole_of, kwargs))
        if isinstance(source, cls) and _writes_first_argument(func):
            return source
        return result


def own_blocks(value, rank: int, world_size: int, group_name: str) -> tuple[int, int, int, int] | None:
    """``(dim, outer, inner, head_tail)`` of a ``GatheredOnUse`` not read yet that holds this rank's block
    in ``group_name``'s layout; None for anything else."""
    if not isinstance(value, GatheredOnUse) or value.gathered:
        return None
    layout = value._layout
    if (layout.rank, layout.world_size, layout.group_name) != (rank, world_size, group_name):
        return None
    return layout.dim, layout.outer, layout.inner, layout.head_tail


def _lazy_whole(block: torch.Tensor, layout: _Layout, length) -> GatheredOnUse:
    return GatheredOnUse(block, None, layout, length, None, [])


_KEEPS_BLOCK = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def _whole_of(value):
    return value.whole() if isinstance(value, GatheredOnUse) else value


def _writes_first_argument(func) -> bool:
    arguments = func._schema.arguments
    return bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write


def _refuse_reshaping_writes(func, args, kwargs) -> None:
    """Ops that change a tensor's shape or strides in place (``transpose_``, ``resize_``, ``out=``):
    the wrapper's own shape would stay the old one."""
    written = [value for value in (args[:1] if _writes_first_argument(func) else ()) if isinstance(value, GatheredOnUse)]
    written += [value for value in (kwargs.get("out"),) if isinstance(value, GatheredOnUse)]
    reshaping = torch.Tag.inplace_view in func.tags or func.__name__.split(".")[0] in ("set_", "resize_") \
        or "out" in kwargs
    if written and reshaping:
        raise UnsupportedError(
            f"{func.__name__} writes into a sequence-sharded output of the compiled model (gathered when read), "
            f"changing its shape or strides in place, which it cannot follow; use the op's out-of-place form "
            f"(x = x.transpose(1, 2), not x.transpose_(1, 2); torch.sum(x, 0), not out=x), or x = x.clone() first"
        )


def _refuse_traced_writes(func, source) -> None:
    """A graph being compiled that writes in place into a sequence-sharded value of the graph before it:
    the write would land on the whole the graph gathers, and its gradient would not reach the block."""
    if isinstance(source, GatheredOnUse) and source.requires_grad and not source._kept and is_fake(source._source) \
            and _writes_first_argument(func):
        raise UnsupportedError(
            f"{func.__name__} writes in place into a sequence-sharded value that a compiled graph before this one "
            f"left as the rank's block (the hidden states crossing a graph break, or the output of a block "
            f"compiled on its own), which this graph cannot write; use the op's out-of-place form (x = x * 2, not "
            f"x.mul_(2)), or compile with options={{'outputs': 'gather'}}, which gathers such values"
        )


def _gather(block: torch.Tensor, layout: _Layout, length: int) -> torch.Tensor:
    return gather_blocks(block, layout.dim, layout.outer, layout.inner, length, layout.world_size, layout.group_name,
                         layout.head_tail)


def _agree_on_read(read: _Read | None, layout: _Layout, device, written: bool) -> bool:
    """Every rank reads the same output of the same call (a small all-gather of what each reads, and
    whether the weight of logits computed when read was written since on the rank); whether it was on
    any rank. Without a read to name (a tensor rebuilt by AOTAutograd), this rank's ``written``."""
    if read is None:
        return written
    try:
        rows = gather_rows([*read.row(), int(written)], device, layout.world_size, layout.group_name)
    except RuntimeError as failure:
        if not is_collective_failure(failure):
            raise
        raise CollectiveError(
            f"rank {layout.rank}: reading the sequence-sharded {read.name} gathers it from every rank, and the "
            f"gather did not complete ({failure}). Another rank did not read it (a read under `if rank == 0:`), "
            f"or failed: look for its error. Read the outputs on every rank, or compile with "
            f"options={{'outputs': 'gather'}}"
        ) from failure
    if any(row[:4] != read.row() for row in rows):
        others = "; ".join(f"rank {rank} read {read.describe(row[:4])}"
                           for rank, row in enumerate(rows) if row[:4] != read.row())
        raise CollectiveError(
            f"rank {layout.rank}: reading the sequence-sharded {read.name} ({read.describe(read.row())}) "
            f"gathers it from every rank, and the ranks read different outputs: {others}. Read a "
            f"compiled model's outputs on every rank in the same order (not under `if rank == 0:`), or compile "
            f"with options={{'outputs': 'gather'}} to gather them inside the graph"
        )
    return any(row[4] for row in rows)


class _LeaveSharded(torch.autograd.Function):
    """The rank's block -> ``GatheredOnUse``; the gradient of the whole goes back as the block's share
    (the rank's block of it, as ``gather_seq``'s backward)."""

    @staticmethod
    def forward(ctx, block, layout: _Layout, length, read: _Read):
        ctx.layout = layout
        return GatheredOnUse(block.detach(), None, layout, length, read, [])

    @staticmethod
    def backward(ctx, grad):
        return _block_of_gradient(grad, ctx.layout), None, None, None


def _block_of_gradient(grad: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """This rank's block of the gradient of a whole: a lazy gradient's own block (handed back by the next
    compiled graph, ``collectives.scatter_seq``), else taken from the whole."""
    own = grad.own_block(layout.dim, layout.outer, layout.inner, layout.rank, layout.world_size,
                         layout.group_name, layout.head_tail) if isinstance(grad, GatheredOnUse) else None
    if own is not None:
        return own
    return take_block(grad, layout.dim, layout.outer, layout.inner, layout.rank, layout.world_size,
                      layout.head_tail).contiguous()


class _LeaveShardedLinear(torch.autograd.Function):
    """The rank's hidden rows and the LM head weight's source -> ``GatheredOnUse`` of their ``linear``,
    computed when read; the gradient of the whole goes back as the block's share, through ``linear``'s
    backward to the rows, and through the weight's chain (its gradient reductions) to the source."""

    @staticmethod
    def forward(ctx, rows, source, lazy: LazyLinear, layout: _Layout, length, read: _Read):
        ctx.layout, ctx.chain = layout, lazy.chain
        ctx.save_for_backward(rows, source)
        block = LinearRows(rows.detach(), source.detach(), lazy.chain, version_counter(source), read.name, lazy.vocab)
        return GatheredOnUse(block, None, layout, length, read, [])

    @staticmethod
    def backward(ctx, grad):
        rows, source = ctx.saved_tensors
        block = _block_of_gradient(grad, ctx.layout)
        with torch.enable_grad():
            leaf = source.detach().requires_grad_(ctx.needs_input_grad[1])
            weight = ctx.chain(leaf)
        grad_rows = block @ weight.detach() if ctx.needs_input_grad[0] else None
        grad_source = None
        if ctx.needs_input_grad[1]:
            grad_weight = block.reshape(-1, block.shape[-1]).t() @ rows.reshape(-1, rows.shape[-1])
            (grad_source,) = torch.autograd.grad(weight, leaf, grad_weight)
        return grad_rows, grad_source, None, None, None, None


def computed_outputs(outputs, computed: dict[int, LazyLinear]) -> list:
    """A compiled graph's outputs as the captured graph returns them: the hidden rows at each position of
    ``computed`` replaced by their ``linear`` with the weight made from its source (differentiable), the
    appended sources dropped."""
    outputs = list(outputs)
    for position, lazy in computed.items():
        outputs[position] = torch.nn.functional.linear(outputs[position], lazy.chain(outputs[lazy.weight]))
    return outputs[:len(outputs) - len(computed)]


def leave_sharded(compiled, sharded: dict[int, SequenceBlocks], computed: dict[int, LazyLinear], options, group,
                  graph_name: str, graph: int):
    """``compiled`` with its sequence-sharded outputs (position -> blocks) returned to the caller as
    ``GatheredOnUse`` (``outputs="lazy"``) or DTensors (``"dtensor"``); the outputs in ``computed``
    (``computed_outputs``) are computed only when read. ``graph`` names the program alike on every rank
    (``agreement.program_digest``)."""
    if not sharded:
        return compiled
    rank, world_size, group_name = group.rank(), group.size(), options.group_name()
    mesh_of = _sequence_mesh(options, group)
    calls = itertools.count(1)

    def run(*args):
        outputs = list(compiled(*args))
        sources = {position: outputs[lazy.weight] for position, lazy in computed.items()}
        outputs = outputs[:len(outputs) - len(computed)]
        call = next(calls) if options.outputs == "lazy" else None
        for position, blocks in sharded.items():
            block = outputs[position]
            if options.outputs == "dtensor":
                outputs[position] = DTensor.from_local(block, mesh_of(block.device.type), [DTensorShard(blocks.dim)],
                                                       run_check=False)
                continue
            layout = _Layout(blocks.dim, blocks.outer, blocks.inner, rank, world_size, group_name, blocks.head_tail)
            read = _Read(f"output {position} of {graph_name}", graph, torch.is_grad_enabled(), call, position)
            length = blocks.whole_length(block, world_size)
            outputs[position] = _LeaveSharded.apply(block, layout, length, read) if position not in sources \
                else _LeaveShardedLinear.apply(block, sources[position], computed[position], layout, length,
                                               read)
        return outputs

    return run


def _sequence_mesh(options, group):
    """The sequence-parallel ranks as a one-dim ``DeviceMesh`` (made once per device type): the mesh
    option's (``Options.sequence_mesh``), or one named ``"sp"`` over ``group``."""
    meshes: dict[str, DeviceMesh] = {}

    def mesh_of(device_type: str) -> DeviceMesh:
        if device_type not in meshes:
            if options.mesh is not None and options.mesh.device_type == device_type:
                meshes[device_type] = options.sequence_mesh()
            else:
                meshes[device_type] = DeviceMesh.from_group(group, device_type, mesh_dim_names=("sp",))
        return meshes[device_type]

    return mesh_of


def refuse_dtensor_inputs(names: list[str], example_inputs) -> None:
    """A DTensor input (Dynamo traced the graph with DTensor's rules, so every tensor it meets is one
    too) has no global value for the passes to start from."""
    for name, value in zip(names, example_inputs):
        if isinstance(value, DTensor):
            raise UnsupportedError(
                f"input {name} is a DTensor placed {tuple(value.placements)}; the ulysses backend takes plain "
                f"global tensors (every rank the same): pass {name}.full_tensor(), or call the model on the "
                f"tensors it was given before they were distributed"
            )
