"""A per-rank memory estimate of one training step, read from the programs AOTAutograd derives.

Each Dynamo graph's forward and backward programs are walked in order as eager execution runs them:
every op's result is allocated when the op runs (a view, ``wait_tensor`` or an in-place op's result
shares its input's storage) and freed after the last use of its storage, unless the program returns
it. The forward returns the values saved for the backward, which stay alive until their last use in
that graph's backward. Sizes are sympy expressions where the sequence length is symbolic, so one trace
gives the estimate at every length (:meth:`StepMemory.at`).

The step, per rank, on top of the parameters and optimizer state held between steps:

    forward of graph g:    the saved values of the graphs before g + what g's forward holds at once
    backward of graph g:   the saved values of the graphs before g + the gradients made so far
                           + what g's backward holds at once (its saved values until their last use)
    optimizer step:        the gradients + the optimizer's temporaries (one largest shard per state)

Left out: the allocator's fragmentation and caching (a CUDA caching allocator keeps freed blocks),
communication buffers of the process group, kernel workspaces (Inductor's fused kernels allocate fewer
temporaries than the eager programs counted here), the optimizer state's creation at the first step.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from ulysses_compile.core.compat import aliases_first_input, c10d_functional, op_name, symbol_hints, symbolic_expr
from ulysses_compile.core.errors import UlyssesError
from ulysses_compile.core.runtime import token_loss_chunk_rows
from ulysses_compile.core.sizes import is_symbolic

_LARGEST = 5  # allocations listed at the peak
_LONGEST = 2**40  # tokens: a search past it is not searching a length
# Results that are their first input: the collective's buffer it waited for; a fresh tensor viewed
# in another shape (matmul's result)
_ALIASING = {c10d_functional.wait_tensor.default, torch.ops.aten._unsafe_view.default}


def _size(size, hints: dict) -> int | sympy.Expr:
    """A size as an int or an expression of the size symbols; ``hints`` collects the symbols' values
    in the call traced."""
    if not is_symbolic(size):
        return size
    expr = symbolic_expr(size)
    hints.update({symbol: int(value) for symbol, value in symbol_hints(size, expr.free_symbols).items()})
    return expr


def _bytes(value, hints: dict) -> int | sympy.Expr:
    """A tensor's bytes (of every tensor in a tuple)."""
    if isinstance(value, (tuple, list)):
        return sum((_bytes(item, hints) for item in value), 0)
    if not isinstance(value, torch.Tensor):
        return 0
    return _size(value.numel(), hints) * value.element_size()


def _aliases_input(node: fx.Node) -> bool:
    return bool(node.args) and isinstance(node.args[0], fx.Node) and (
        node.target in _ALIASING or aliases_first_input(node.target))


def _workspace(node: fx.Node, hints: dict) -> int | sympy.Expr:
    """Bytes an opaque op allocates inside one call beyond its results: one chunk's values of the tiled
    loss (forward: the logits and their log-probabilities; backward: also the gradients of both) and of
    the tiled MLP (forward: the gate and up projections, the activation and the product; backward: also
    the gradients of the product and of the gate and up projections), and in the backward the weights'
    gradient sums."""
    name = op_name(node)
    if name in ("ulysses_compile::tiled_gated_mlp", "ulysses_compile::tiled_gated_mlp_backward"):
        x, gate_weight = (arg.meta["val"] for arg in node.args[-5:-3])
        intermediate, width = gate_weight.shape
        chunk = sympy.Min(_size(x.numel() // width, hints), width) * intermediate * x.element_size()
        if name.endswith("backward"):
            return 7 * chunk + _weight_gradient_workspace(gate_weight, 3)
        return 4 * chunk
    if name not in ("ulysses_compile::token_loss_sum", "ulysses_compile::token_loss_sum_backward"):
        return 0
    hidden, weight = (arg.meta["val"] for arg in node.args[1:3])
    vocab, width = weight.shape
    chunk = sympy.Min(_size(hidden.shape[0], hints), token_loss_chunk_rows(vocab)) * vocab * 4
    upcast = 0 if hidden.dtype == torch.float32 else chunk
    if name.endswith("backward"):
        return 3 * chunk + upcast + _weight_gradient_workspace(weight, 1)
    return 2 * chunk + upcast


def _weight_gradient_workspace(weight, count: int) -> int:
    """One chunk's fp32 product for a weight's gradient, and the fp32 sums of ``count`` weights' gradients
    where they are not the op's results (weights in another dtype)."""
    fp32 = weight.numel() * 4
    return fp32 + (0 if weight.dtype == torch.float32 else count * fp32)


@dataclass
class Timeline:
    """One program's allocations in execution order: ``sizes[i]`` bytes alive from step ``born[i]``
    through step ``freed[i]`` (the last step, for values the program returns)."""

    sizes: list[int | sympy.Expr] = field(default_factory=list)
    born: list[int] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # the node that allocated each (a workspace: "op (workspace)")
    storage: dict[str, str] = field(default_factory=dict)  # node name -> the node whose allocation it uses
    allocated: dict[str, int | sympy.Expr] = field(default_factory=dict)  # node name -> the bytes it allocated

    @classmethod
    def of(cls, graph: fx.Graph, held: set[fx.Node], hints: dict, inputs: dict | None = None) -> Timeline:
        """The allocations of ``graph``; placeholders in ``held`` are alive throughout and not counted
        (the caller counts them), other placeholders (values handed in) are allocated at the start and
        freed after their last use: ``inputs`` maps a placeholder's name to (the storage it shares with
        other placeholders, its bytes). Each item of a multi-output op is its own allocation, made when
        the op runs; items nobody reads are freed at once."""
        nodes = list(graph.nodes)
        position = {node: index for index, node in enumerate(nodes)}
        storage: dict[fx.Node, fx.Node] = {}  # node -> the node whose allocation it uses
        first_of: dict[str, fx.Node] = {}  # an input storage -> its first placeholder
        for node in nodes:
            if node.op == "placeholder" and inputs and node.name in inputs:
                storage[node] = first_of.setdefault(inputs[node.name][0], node)
            elif _aliases_input(node) or (node.target is operator.getitem
                                          and storage[node.args[0]] is not node.args[0]):
                storage[node] = storage[node.args[0]]
            else:
                storage[node] = node
        last_use = {}
        for node in nodes:
            for used in node.all_input_nodes:
                last_use[storage[used]] = position[node]
        returned = {storage[node] for node in graph.output_node().all_input_nodes}
        timeline = cls(storage={node.name: owner.name for node, owner in storage.items()})
        end = len(nodes) - 1

        def allocate(size, born: int, freed: int, name: str, owner: fx.Node | None = None) -> None:
            if size != 0:
                timeline.sizes.append(size)
                timeline.born.append(born)
                timeline.freed.append(freed)
                timeline.names.append(name)
                if owner is not None:
                    timeline.allocated[owner.name] = size

        for node in nodes:
            if storage[node] is not node or node.op == "output" or node in held:
                continue
            if node.op == "call_function":
                allocate(_workspace(node, hints), position[node], position[node], f"{node.name} (workspace)")
            freed = end if node in returned else last_use.get(node, position[node])
            value = node.meta.get("val")
            if node.op == "placeholder" and inputs and node.name in inputs:
                allocate(inputs[node.name][1], position[node], freed, node.name)
            elif node.target is operator.getitem:  # an item of a multi-output op, made when the op ran
                allocate(_bytes(value, hints), position[node.args[0]], freed, node.name, node)
            elif isinstance(value, (tuple, list)):
                read = {user.args[1] for user in node.users if user.target is operator.getitem}
                allocate(_bytes([item for index, item in enumerate(value) if index not in read], hints),
                         position[node], position[node], node.name)
            else:
                allocate(_bytes(value, hints), position[node], freed, node.name, node)
        return timeline

    def peak(self, sizes: list[int]) -> int:
        """The most bytes alive at once, with each allocation's size evaluated (``sizes``)."""
        return self.peak_step(sizes)[0]

    def peak_step(self, sizes: list[int]) -> tuple[int, int]:
        """The most bytes alive at once and the first step at which they are."""
        change = [0] * (max(self.freed, default=0) + 2)
        for size, born, freed in zip(sizes, self.born, self.freed):
            change[born] += size
            change[freed + 1] -= size
        alive, most, at = 0, 0, 0
        for step, delta in enumerate(change):
            alive += delta
            if alive > most:
                most, at = alive, step
        return most, at

    def alive_at(self, step: int, sizes: list[int]) -> list[tuple[str, int]]:
        """The allocations alive at ``step``, largest first."""
        alive = [(name, size) for name, size, born, freed in zip(self.names, sizes, self.born, self.freed)
                 if born <= step <= freed]
        return sorted(alive, key=lambda item: -item[1])


@dataclass
class GraphMemory:
    """One Dynamo graph's programs: the forward's allocations, the values it saves for the backward,
    the backward's allocations and the gradients it returns."""

    forward: Timeline
    saved: int | sympy.Expr = 0
    backward: Timeline = field(default_factory=Timeline)
    gradients: int | sympy.Expr = 0

    @classmethod
    def of_forward(cls, graph: fx.Graph, hints: dict) -> GraphMemory:
        """The forward's inputs (parameters, ZeRO shards, the batch, an earlier graph's outputs) are
        held by the caller."""
        return cls(Timeline.of(graph, set(graph.find_nodes(op="placeholder")), hints))

    def add_backward(self, graph: fx.Graph, hints: dict) -> None:
        """The backward's inputs besides the gradients are the values the forward saved, named as the
        forward's nodes (AOTAutograd's partitioner keeps the names): each storage counts once, views
        of the forward's inputs (parameters, shards) not at all, and each is freed after its last use
        (AOTAutograd clears the saved tensors as the backward starts and the program drops each after
        its last use)."""
        saved = [node for node in graph.find_nodes(op="placeholder") if not node.name.startswith("tangents")]
        inputs = {}
        for node in saved:
            owner = self.forward.storage.get(node.name, node.name)
            if owner in self.forward.allocated:
                inputs[node.name] = (owner, self.forward.allocated[owner])
        self.saved = sum(dict(inputs.values()).values(), 0)
        self.backward = Timeline.of(graph, {node for node in saved if node.name not in inputs}, hints, inputs)
        self.gradients = sum((_bytes(node.meta.get("val"), hints) for node in graph.output_node().all_input_nodes), 0)


@dataclass
class MemoryFigures:
    """Bytes per rank at one sequence length."""

    parameters: int
    gradients: int
    optimizer_state: int
    saved: int  # activations (and ZeRO 1-2's gathered parameters) kept for the backward
    transient: int  # the most alive at once above parameters, optimizer state and saved values
    peak: int  # parameters + optimizer state + the step's most
    peak_in: str = field(default="", compare=False)  # the program and its node where the step's most is
    largest_at_peak: list = field(default_factory=list, compare=False)  # (what, bytes), largest first

    def __str__(self) -> str:
        rows = [("parameters", self.parameters), ("gradients", self.gradients),
                ("optimizer state", self.optimizer_state), ("saved for the backward", self.saved),
                ("largest transient", self.transient), ("peak", self.peak)]
        lines = [f"  {name:<24} {_mib(size):>12}" for name, size in rows]
        if self.peak_in:
            lines.append(f"  the peak is in {self.peak_in}; largest then: "
                         + ", ".join(f"{what} {_mib(size)}" for what, size in self.largest_at_peak))
        return "\n".join(lines)


def _at(timeline: Timeline, step: int) -> str:
    """The node whose allocation reaches the peak at ``step``."""
    born_then = [name for name, born in zip(timeline.names, timeline.born) if born == step]
    return f"at {born_then[-1]}" if born_then else f"step {step}"


def _mib(size: int) -> str:
    return f"{size / 2**20:,.1f} MiB"


@dataclass
class StepMemory:
    """The estimate: the graphs' programs, the parameters this rank holds and its optimizer."""

    graphs: list[GraphMemory]  # in the order they run, a graph run for several layers once per run
    numbers: list[int]  # the number of each run's graph in the report (``Report.graphs``)
    parameters: int  # bytes this rank holds (a ZeRO shard: its rows)
    trainable: int  # of which require gradients
    largest_shard: int
    optimizer_states: int  # tensors the size of each trainable parameter the optimizer keeps (AdamW: 2)
    hints: dict = field(default_factory=dict)  # size symbol -> its value in the call traced (from _bytes)

    def at(self, values: dict | None = None) -> MemoryFigures:
        """The figures with the size symbols at ``values`` (default: the call traced)."""
        values = {**self.hints, **(values or {})}

        def evaluate(size) -> int:
            return int(size.subs(values)) if isinstance(size, sympy.Expr) else int(size)

        state = self.optimizer_states * self.trainable
        saved = [evaluate(graph.saved) for graph in self.graphs]
        grads = [evaluate(graph.gradients) for graph in self.graphs]
        temporaries = self.optimizer_states * self.largest_shard
        most, peak_in = self.trainable + temporaries, "the optimizer step"
        largest = [("gradients", self.trainable), ("the optimizer's temporaries", temporaries)]

        def consider(held: list[tuple[str, int]], timeline: Timeline, program: str) -> None:
            nonlocal most, peak_in, largest
            sizes = [evaluate(size) for size in timeline.sizes]
            alive, step = timeline.peak_step(sizes)
            total = sum(size for _, size in held) + alive
            if total > most:
                most, peak_in = total, f"{program}, {_at(timeline, step)}"
                largest = sorted([*held, *timeline.alive_at(step, sizes)], key=lambda item: -item[1])[:_LARGEST]

        for index, graph in enumerate(self.graphs):
            consider([("saved by earlier graphs", sum(saved[:index]))], graph.forward, f"the forward of graph {self.numbers[index]}")
        for index in reversed(range(len(self.graphs))):
            held = [("saved by earlier graphs", sum(saved[:index])), ("gradients of later graphs", sum(grads[index + 1:]))]
            consider(held, self.graphs[index].backward, f"the backward of graph {self.numbers[index]}")
        return MemoryFigures(parameters=self.parameters, gradients=self.trainable, optimizer_state=state,
                             saved=sum(saved), transient=max(0, most - sum(saved)),
                             peak=self.parameters + state + most, peak_in=peak_in,
                             largest_at_peak=[item for item in largest if item[1]])

    def longest(self, symbol, limit: int, step: int, start: int) -> int | None:
        """The longest multiple of ``step`` for ``symbol`` (the sequence length) whose peak is within
        ``limit`` bytes, None if ``step`` does not fit. The peak grows with the length: from ``start``,
        doubling or halving to a bracket, then a bisection."""
        def fits(length: int) -> bool:
            return self.at({symbol: length}).peak <= limit

        if not fits(step):
            return None
        low = high = max(step, start // step * step)
        while fits(high):
            if high > _LONGEST:
                raise UlyssesError(f"the estimated peak does not grow with {symbol}: it is not the sequence length")
            low, high = high, high * 2
        while not fits(low):
            high, low = low, max(step, low // 2 // step * step)
        while high - low > step:
            middle = (low + high) // (2 * step) * step
            low, high = (middle, high) if fits(middle) else (low, middle)
        return low
