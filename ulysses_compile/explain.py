"""``explain(model, *args, world_size=P, **kwargs)``: what the backend would do at P ranks, in one process.

A copy of the model is compiled with the ulysses backend against a fake process group of P ranks (this
process plays rank ``rank``; its collectives move no data, so values are meaningless but every shape is
the real one), run forward and backward once, and summarized: each attention site with its verdict at
this P, every collective of the forward and backward programs AOTAutograd derives (bytes per call, totals
next to the Ulysses minimum), fallbacks with their source lines, graph breaks, the activations saved for
the backward, and each graph's code before and after every pass.

    report = ulysses_compile.explain(model, input_ids=ids, labels=ids, world_size=8)
    print(report)                        # the summary table
    report.graphs[0].graphs["insert_all_to_all"]   # code after a pass; .captured is Dynamo's graph

A model built on the meta device (``with torch.device("meta"): model = ...``, ids on meta too) is planned
without any memory for its weights or activations: its copy's parameters, buffers and the inputs become
fake CPU tensors (tied weights stay tied), and the report is the one real weights give, with a note in
each graph's notes.

Like ``torch._dynamo.explain`` it resets the compiler's caches first.

``explain_generation(model, input_ids, world_size=P, new_tokens=N)`` does the same for inference: the
prompt's call with a KV cache (``use_cache=True``) and N decoding steps over it, under ``no_grad``; it
reports each call's plan and collectives and the cache each rank holds against one device's.
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ulysses_compile.backend import aot, reduce_scatter_bucket_mib, rewrite, ulysses
from ulysses_compile.core.boundary import GatheredOnUse, leave_sharded
from ulysses_compile.core.collectives import ring_rank
from ulysses_compile.core.compat import (
    BackendCompilerFailed,
    FakeTensorMode,
    buffer_slots,
    c10d_functional,
    dynamo_counters,
    make_boxed_func,
    parameter_slots,
    register_fake_backend,
    symbolic_hint,
    tree_leaves,
    tree_map,
)
from ulysses_compile.core.errors import UlyssesError
from ulysses_compile.core.memory import GraphMemory, StepMemory
from ulysses_compile.core.options import Options
from ulysses_compile.core.report import CollectiveCall, GraphReport, Report, SiteReport, module_path
from ulysses_compile.core.ring_attention import causal_work, ring_attention_ops
from ulysses_compile.core.sharding import block_sizes, sharding_of
from ulysses_compile.core.sizes import as_int, is_symbolic, same_size
from ulysses_compile.passes.bucket_zero_gathers import inductor_buckets
from ulysses_compile.passes.pipeline import PROJECTIONS_ON_HEADS
from ulysses_compile.verify import differentiable_scalar
from ulysses_compile.zero import compile_partitioned

FAKE_NOTE = "explained on fake tensors (the model or its inputs are on the meta device): no value was computed"

# The functional collectives AOTAutograd leaves in the forward and backward programs.
COLLECTIVE_OPS = {
    c10d_functional.all_to_all_single.default: "all_to_all",
    c10d_functional.all_gather_into_tensor.default: "all_gather",
    c10d_functional.reduce_scatter_tensor.default: "reduce_scatter",
    c10d_functional.all_reduce.default: "all_reduce",
}


def explain(model: torch.nn.Module, *args, world_size: int, rank: int = 0, options: dict | None = None,
            zero_stage: int = 0, param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
            optimizer_states: int = 2, dynamic: bool | None = None, **kwargs) -> Report:
    """Report what ``torch.compile(model, backend="ulysses", options=options)`` (``parallelize(model,
    zero_stage=zero_stage, param_dtype=param_dtype, reduce_dtype=reduce_dtype)`` for a stage above 0)
    does to ``model(*args, **kwargs)`` on rank ``rank`` of ``world_size`` sequence-parallel ranks, without
    launching them. The memory estimate counts ``optimizer_states`` tensors the size of each trainable
    parameter (AdamW and Adam: 2; SGD with momentum: 1). ``dynamic=True`` traces with symbolic sizes (torch.compile's), so the estimate is a
    function of the sequence length (``report.memory.at({symbol: length})``, ``.longest``). The model is
    traced as ``parallelize`` traces it: a checkpointed region that mutates Python state is traced whole."""
    _check_simulation("explain", world_size, rank)
    if not (isinstance(optimizer_states, int) and optimizer_states >= 0):
        raise UlyssesError(f"explain(optimizer_states={optimizer_states!r}): expected how many tensors the size "
                           f"of each parameter the optimizer keeps, 0 or more (AdamW: 2)")
    opts = Options.parse({**(options or {}), "compiler": "aot_eager"})
    report = Report(world_size=world_size, rank=rank)
    explained: list[_Explained] = []
    hints: dict = {}
    model = copy.deepcopy(model)
    # a checkpointed region that draws random numbers (SDPA) replays the real generator state in the backward
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if _on_meta(model, args, kwargs) else None
    if fake_mode is not None:
        args, kwargs = _to_fake(model, (args, kwargs), fake_mode)
    with _simulated_ranks(world_size, rank):
        # outside the fake mode: the device mesh ZeRO builds reads its ranks from a tensor
        compiled = compile_partitioned(
            model, lambda gm, inputs: _compile(gm, inputs, opts, report, explained, hints),
            zero_stage=zero_stage, group=None, mesh=None, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
            options=dict(options or {}), dynamic=dynamic)
        with fake_mode or contextlib.nullcontext():
            scalar = differentiable_scalar(compiled(*args, **kwargs))
            if scalar is not None:
                scalar.backward()
    report.graph_breaks = [f"{reason} (x{count})" for reason, count in
                           dynamo_counters["graph_break"].items()]
    if fake_mode is not None:
        for graph in report.graphs:
            graph.notes.append(FAKE_NOTE)
    runs = [explained[index] for index in report.runs]
    for run in runs:
        report.attention_sites += run.sites
        report.ulysses_minimum_bytes += run.minimum_bytes
        report.ring_minimum_bytes += run.ring_minimum_bytes
        report.collectives += run.collectives["forward"]
    for run in reversed(runs):  # the backward runs the graphs' programs in reverse
        report.collectives += run.collectives["backward"]
    for run in runs:
        report.calls_under_inductor += run.calls_under_inductor
    report.memory = _step_memory(model, [(index, explained[index].memory) for index in report.runs
                                         if explained[index].memory is not None], optimizer_states, hints)
    return report


def _check_simulation(name: str, world_size, rank) -> None:
    if not isinstance(world_size, int) or world_size < 2:
        raise UlyssesError(f"{name}(world_size={world_size!r}): expected the number of ranks to simulate, 2 or more")
    if not 0 <= rank < world_size:
        raise UlyssesError(f"{name}(rank={rank!r}): expected a rank in 0..{world_size - 1}")
    if dist.is_initialized():
        raise UlyssesError(
            f"{name} simulates the ranks with a process group of its own, and torch.distributed is already "
            f"initialized in this process; call {name} before init_process_group, or in another process "
            f"(python -m ulysses_compile explain FILE.py:FACTORY --world-size P)"
        )


@contextlib.contextmanager
def _simulated_ranks(world_size: int, rank: int):
    """This process as rank ``rank`` of a fake process group of ``world_size`` (its collectives move no
    data), the compiler's caches and counters reset first and its caches after; a compile failure that is
    our verdict (more ranks than heads...) raised as itself, not as Dynamo's wrapper."""
    torch.compiler.reset()
    dynamo_counters.clear()
    register_fake_backend()
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        yield
    except BackendCompilerFailed as failure:
        if isinstance(failure.inner_exception, UlyssesError):
            raise failure.inner_exception from None
        raise
    finally:
        dist.destroy_process_group()
        torch.compiler.reset()


@dataclass
class GenerationReport:
    """What ``explain_generation`` found for rank ``rank`` of ``world_size``: the graphs of the prompt's
    call and of the decoding steps (each a ``GraphReport``: sites with their plans, collectives), and the
    KV cache this rank holds after the last step against one device's."""

    world_size: int
    rank: int
    prompt: list[GraphReport]
    decoding: list[GraphReport]
    cache_bytes: int
    whole_cache_bytes: int
    cache_layout: str  # how the rank holds it: its heads, its sequence blocks, or whole

    def __str__(self) -> str:
        lines = [f"ulysses_compile generation at P = {self.world_size} (rank {self.rank}): the prompt in "
                 f"{len(self.prompt)} graph(s), decoding in {len(self.decoding)} graph(s)"]
        for name, graphs in (("prompt", self.prompt), ("decoding", self.decoding)):
            for graph in graphs:
                if graph.replicated:
                    lines.append(f"  {name}: runs replicated: {graph.replicated}")
                lines += [f"  {name}: {site.summary()}" for site in graph.attention_sites]
                lines += [f"  {name}: {note}" for note in graph.notes if note.startswith(PROJECTIONS_ON_HEADS)]
                kinds = Counter(call.kind for call in graph.collectives if call.kind not in _BACKWARD_ONLY)
                lines.append(f"  {name}: collectives per call: "
                             + (", ".join(f"{kind} x{count}" for kind, count in kinds.items()) or "none"))
        share = self.cache_bytes / self.whole_cache_bytes if self.whole_cache_bytes else 0.0
        lines.append(f"  KV cache per rank: {self.cache_bytes:,} bytes, {share:.3f} of one device's "
                     f"{self.whole_cache_bytes:,} ({self.cache_layout})")
        return "\n".join(lines)


_BACKWARD_ONLY = ("sync_grad", "average_grad")  # identities forward: their reductions run in a backward


def explain_generation(model: torch.nn.Module, input_ids: torch.Tensor, *, world_size: int, new_tokens: int = 2,
                       rank: int = 0, options: dict | None = None, **kwargs) -> GenerationReport:
    """Report what ``torch.compile(model, backend="ulysses", options=options)`` does, on rank ``rank`` of
    ``world_size``, to a transformers model's prompt call ``model(input_ids, use_cache=True, **kwargs)``
    and ``new_tokens`` decoding steps over its cache (``model(input_ids[:, -1:], past_key_values=...,
    use_cache=True)``: the prompt's last token fed again, as values do not matter on the simulated ranks),
    under ``no_grad``."""
    _check_simulation("explain_generation", world_size, rank)
    if not (isinstance(new_tokens, int) and new_tokens >= 1):
        raise UlyssesError(f"explain_generation(new_tokens={new_tokens!r}): expected how many decoding steps, 1 or more")
    opts = {**(options or {}), "compiler": "aot_eager", "check_inputs": False}  # the ranks' values are not real
    graphs: list[GraphReport] = []

    def backend(gm, example_inputs):
        compiled = ulysses(gm, example_inputs, options=opts)
        graphs.append(gm.meta["ulysses_report"])
        return compiled

    model = copy.deepcopy(model)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if _on_meta(model, (input_ids,), kwargs) else None
    if fake_mode is not None:
        input_ids, kwargs = _to_fake(model, (input_ids, kwargs), fake_mode)
    with _simulated_ranks(world_size, rank):
        compiled = torch.compile(model, backend=backend)
        # outside the fake mode: the ranks' first-call agreement gathers real objects; the fake inputs'
        # ops run in their own mode
        with torch.no_grad():
            output = compiled(input_ids=input_ids, use_cache=True, **kwargs)
            prompt = len(graphs)
            for _ in range(new_tokens):
                output = compiled(input_ids=input_ids[:, -1:], past_key_values=output.past_key_values,
                                  use_cache=True)
        held, whole, layouts = 0, 0, set()
        for tensor in tree_leaves([(layer.keys, layer.values) for layer in output.past_key_values.layers]):
            block = tensor._block if isinstance(tensor, GatheredOnUse) else tensor
            held += block.numel() * block.element_size()
            whole += tensor.numel() * tensor.element_size()
            layouts.add(("the rank's heads" if tensor._layout.dim == 1 else "the rank's sequence blocks")
                        if isinstance(tensor, GatheredOnUse) else "whole on every rank")
    if fake_mode is not None:
        for graph in graphs:
            graph.notes.append(FAKE_NOTE)
    return GenerationReport(world_size, rank, graphs[:prompt], graphs[prompt:], held, whole, ", ".join(sorted(layouts)))


@dataclass
class _Explained:
    """One compiled graph's share of a step, counted once for each time the graph runs (Dynamo runs one
    graph for every layer whose code resumes after a graph break at the same place)."""

    sites: list[SiteReport]
    minimum_bytes: int
    ring_minimum_bytes: int
    collectives: dict[str, list[CollectiveCall]] = field(default_factory=lambda: {"forward": [], "backward": []})
    calls_under_inductor: Counter = field(default_factory=Counter)  # (phase, kind) -> calls once bucketed
    memory: GraphMemory | None = None


def _step_memory(model: torch.nn.Module, runs: list[tuple[int, GraphMemory]], optimizer_states: int,
                 hints: dict) -> StepMemory:
    """``runs``: the number and memory of the graph each run ran."""
    local = [(param.to_local() if isinstance(param, DTensor) else param, param.requires_grad)
             for param in model.parameters()]
    sizes = [(tensor.numel() * tensor.element_size(), trainable) for tensor, trainable in local]
    return StepMemory(graphs=[memory for _, memory in runs], numbers=[number for number, _ in runs],
                      parameters=sum(size for size, _ in sizes),
                      trainable=sum(size for size, trainable in sizes if trainable),
                      largest_shard=max((size for size, trainable in sizes if trainable), default=0),
                      optimizer_states=optimizer_states, hints=hints)


def _on_meta(model: torch.nn.Module, args, kwargs) -> bool:
    tensors = [*model.parameters(), *model.buffers(), *tree_leaves((args, kwargs))]
    return any(isinstance(tensor, torch.Tensor) and tensor.is_meta for tensor in tensors)


def _to_fake(model: torch.nn.Module, inputs, mode):
    """Every parameter and buffer of ``model`` (replaced in place) and every tensor of ``inputs``
    (returned) as a fake tensor of ``mode``: a meta tensor becomes one on the CPU, so that tensors the
    model creates on its inputs' device are fake ones too (``torch.tensor(..., device="meta")`` inside a
    fake mode is a plain meta tensor). A tensor reached twice (tied weights) has one fake copy."""
    copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def fake(tensor):
        if not isinstance(tensor, torch.Tensor):
            return tensor
        if id(tensor) not in copies:  # the original is kept alive with its copy: ids stay unique
            if tensor.is_meta:
                with mode:
                    fake_tensor = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")
                fake_tensor.requires_grad_(tensor.requires_grad)
            else:
                fake_tensor = mode.from_tensor(tensor)
            if isinstance(tensor, torch.nn.Parameter):
                fake_tensor = torch.nn.Parameter(fake_tensor, requires_grad=tensor.requires_grad)
            fake_tensor.__dict__.update(tensor.__dict__)  # what the user attached, e.g. torch._dynamo.mark_dynamic
            copies[id(tensor)] = (tensor, fake_tensor)
        return copies[id(tensor)][1]

    for module in model.modules():
        for slots in (parameter_slots(module), buffer_slots(module)):
            for name, tensor in slots.items():
                slots[name] = fake(tensor)
    return tree_map(fake, inputs)


def _compile(gm, example_inputs, opts: Options, report: Report, explained: list[_Explained], hints: dict):
    ctx, graph_report = rewrite(gm, example_inputs, opts, dist.group.WORLD)
    index = len(report.graphs)
    report.graphs.append(graph_report)
    report.rejected_attention += graph_report.rejected_attention
    report.fallbacks += graph_report.fallbacks
    split = not graph_report.replicated
    graph = _Explained(
        sites=[_site_report(site, ctx.world_size, ctx.rank, graph_report.head_tail)
               for site in graph_report.attention_sites],
        minimum_bytes=sum(_minimum_bytes(site, ctx.world_size, ctx.rank) for site in graph_report.attention_sites
                          if split),
        ring_minimum_bytes=sum(_ring_minimum_bytes(site, ctx.rank)
                               for site in graph_report.attention_sites if split))
    explained.append(graph)
    bucket_mib = reduce_scatter_bucket_mib(gm)

    def keep(phase):
        def compile_phase(program, inputs):
            graph.collectives[phase] = _collective_calls(program, phase)
            graph.calls_under_inductor += _calls_bucketed(program, phase, bucket_mib)
            if phase == "forward":
                graph.memory = GraphMemory.of_forward(program.graph, hints)
            else:
                graph.memory.add_backward(program.graph, hints)
            return make_boxed_func(program.forward)

        return compile_phase

    compiled = leave_sharded(aot(keep("forward"), keep("backward"), not graph_report.rank_specific)(gm, example_inputs),
                             graph_report.sharded_outputs, graph_report.computed_outputs, opts, dist.group.WORLD,
                             f"explained graph {index}", index)

    def run(*args):
        report.runs.append(index)
        return compiled(*args)

    return run


def _site_report(site, world_size: int, rank: int, head_tail: int) -> SiteReport:
    verdicts = _ring_verdicts(site, world_size, rank, head_tail) if site.ring > 1 else _verdicts(site, world_size, rank)
    return SiteReport(
        module=site.module or site.node.name, form=site.spelling, layout=site.layout(), heads=site.heads,
        kv_heads=site.kv_heads, head_dim=site.head_dim, seq_len=site.seq_len, kv_seq_len=site.kv_seq_len,
        mask=site.mask_kind(), decision=site.decision, divisibility="; ".join(verdicts),
    )


def _heads_verdict(heads: int, ranks: int, where: str) -> str:
    blocks = block_sizes(heads, ranks)
    return f"heads {heads} on {where}: " + (
        f"{blocks[0]} each" if len(set(blocks)) == 1 else f"uneven blocks {','.join(map(str, blocks))}")


def _verdicts(site, world_size: int, rank: int) -> list[str]:
    blocks = block_sizes(as_int(site.seq_len), world_size)
    even_blocks = all(same_size(block, blocks[0]) for block in blocks)  # no hashing: a block may be symbolic
    return [
        _heads_verdict(site.heads, world_size, f"{world_size} ranks"),
        f"kv heads {site.kv_heads}: " + ("by all-to-all" if site.kv_by_all_to_all(world_size) else
                                          "each rank gathers the KV heads its query heads use"),
        f"seq {site.seq_len}: " + (f"{blocks[0]} per rank" if even_blocks else
                                   f"uneven blocks {','.join(map(str, blocks))} (rank {rank}: {blocks[rank]})"),
    ]


def _ring_verdicts(site, world_size: int, rank: int, head_tail: int) -> list[str]:
    kv_heads = block_sizes(site.kv_heads, site.ulysses)
    verdicts = [
        _heads_verdict(site.heads, site.ulysses, f"Ulysses groups of {site.ulysses}"),
        f"kv heads {site.kv_heads}: {kv_heads[rank % site.ulysses]} per rank, travelling round the ring un-repeated",
        f"seq {site.seq_len}: {as_int(site.seq_len) // site.ring} per ring rank, "
        f"{as_int(site.seq_len) // world_size} per rank outside attention",
    ]
    if site.is_causal:
        work = causal_work(site.ring, as_int(site.seq_len), bool(head_tail))
        verdicts.append(f"causal work per ring rank, max / min: {max(work) / min(work):.2f} "
                        f"({'head-tail' if head_tail else 'contiguous'} layout)")
    return verdicts


def _ring_minimum_bytes(site, rank: int) -> int:
    """What this rank must receive round the ring of one site: (R - 1) / R of its Ulysses group's share
    of the key/value heads over the key/value sequence, keys and values, forward; twice that backward
    (keys and values again, and their gradients)."""
    if site.ring == 1:
        return 0
    key = sharding_of(site.entering("key")).global_value
    kv_seq = as_int(site.kv_seq_len)
    batch = key.numel() // (key.shape[site.head_axis] * kv_seq * site.head_dim)
    local_kv_heads = block_sizes(site.kv_heads, site.ulysses)[rank % site.ulysses]
    forward = (site.ring - 1) * 2 * batch * local_kv_heads * (kv_seq // site.ring) * site.head_dim
    return _at_call(3 * forward * key.element_size())


def _minimum_bytes(site, world_size: int, rank: int) -> int:
    """What this rank puts into Ulysses' four all-to-alls of one site, forward and backward. Forward: q,
    k, v of its sequence block for all heads and the output of its heads for the whole sequence; the
    backward sends the mirror images: B x (S_r H + 2 T_r H_kv + S H_r) x D and B x (S H_r + 2 T H_kv,r +
    S_r H) x D elements, T the key/value length (2 x B x S/P x (2 H + 2 H_kv) x D when T = S and P
    divides everything)."""
    query = sharding_of(site.entering("query")).global_value
    seq, kv_seq = as_int(site.seq_len), as_int(site.kv_seq_len)
    batch = query.numel() // (site.heads * seq * site.head_dim)
    if site.ring > 1:  # Ulysses within each group, over its chunk of the sequence
        seq, kv_seq = seq // site.ring, kv_seq // site.ring
        world_size, rank = site.ulysses, rank % site.ulysses
        if world_size == 1:
            return 0
    local_seq, local_kv_seq = block_sizes(seq, world_size)[rank], block_sizes(kv_seq, world_size)[rank]
    local_heads = block_sizes(site.heads, world_size)[rank]
    local_kv_heads = block_sizes(site.kv_heads, world_size)[rank]
    forward = local_seq * site.heads + 2 * local_kv_seq * site.kv_heads + seq * local_heads
    backward = seq * local_heads + 2 * kv_seq * local_kv_heads + local_seq * site.heads
    return _at_call(batch * (forward + backward) * site.head_dim * query.element_size())


def _collective_calls(graph, phase: str) -> list[CollectiveCall]:
    calls = []
    for node in graph.graph.nodes:
        if node.target in ring_attention_ops():
            calls.append(_ring_call(node, phase))
        kind = COLLECTIVE_OPS.get(node.target)
        if kind is None:
            continue
        value = node.args[0].meta["val"]
        calls.append(CollectiveCall(
            phase=phase, kind=kind, purpose=(node.meta.get("custom") or {}).get("ulysses_collective", ""),
            where=module_path(node), shape=tuple(as_int(size) for size in value.shape),
            dtype=str(value.dtype).removeprefix("torch."),
            bytes=_at_call(value.numel() * value.element_size()),
        ))
    return calls


def _ring_call(node, phase: str) -> CollectiveCall:
    """A ring attention op's sends on this rank: R - 1 rotations of its key and value blocks, and in the
    backward R - 1 more and R - 1 of their gradients (accumulated in fp32 or wider)."""
    forward = node.target is ring_attention_ops()[0]
    key, value = (node.args[1], node.args[2]) if forward else (node.args[2], node.args[3])
    group_name = node.args[-1]
    _, ring = ring_rank(group_name)
    key, value = key.meta["val"], value.meta["val"]
    kv_bytes = key.numel() * key.element_size() + value.numel() * value.element_size()
    accumulated = torch.promote_types(key.dtype, torch.float32).itemsize * (key.numel() + value.numel())
    sent = (ring - 1) * (kv_bytes if forward else kv_bytes + accumulated)
    return CollectiveCall(phase=phase, kind="ring", purpose="ring_attention", where=module_path(node),
                          shape=tuple(as_int(size) for size in key.shape), dtype=str(key.dtype).removeprefix("torch."),
                          bytes=_at_call(sent))


def _calls_bucketed(program, phase: str, reduce_scatter_mib: float) -> Counter:
    """(phase, kind) -> the calls of ``program``'s collectives once Inductor buckets them
    (``backend.bucketing``)."""
    calls = Counter((phase, COLLECTIVE_OPS[node.target]) for node in program.graph.nodes
                    if node.target in COLLECTIVE_OPS)
    calls[phase, "ring"] += sum(node.target in ring_attention_ops() for node in program.graph.nodes)
    for bucket in inductor_buckets(program, reduce_scatter_mib):
        calls[phase, COLLECTIVE_OPS[bucket[0].target]] -= len(bucket) - 1
    return calls


def _at_call(size) -> int:
    """A byte count at the sizes of the call explained (a symbolic length at its value there)."""
    return symbolic_hint(size) if is_symbolic(size) else size
