"""The one place that imports private torch APIs, so a torch upgrade breaks in one file."""

from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._dynamo.exc import BackendCompilerFailed
from torch._dynamo.utils import counters as dynamo_counters
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._guards import CompileContext
from torch._dynamo.utils import orig_code_map
from torch._inductor.compile_fx import compile_fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.fx_passes.bucketing import (
    bucket_all_gather_by_mb,
    bucket_all_reduce_by_mb,
    bucket_cap_mb_by_bucket_idx_default,
    bucket_reduce_scatter_by_mb,
    is_all_gather_into_tensor,
    is_wait_tensor,
    merge_all_gather,
)
from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, is_fake
from torch._logging import trace_structured
from torch._inductor import list_mode_options
from torch.distributed import distributed_c10d
from torch.distributed.distributed_c10d import _resolve_process_group
from torch._C._distributed_c10d import _register_process_group, _unregister_process_group
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, free_unbacked_symbols, statically_known_true
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.proxy import GraphAppendingTracer
from torch.utils._sympy.interp import sympy_interp
from torch.utils._sympy.reference import PythonReferenceAnalysis
from torch.utils._ordered_set import OrderedSet
from torch.utils._pytree import tree_leaves, tree_map

__all__ = [
    "version_counter",
    "BackendCompilerFailed",
    "boxed_nop",
    "buffer_slots",
    "CompileContext",
    "FakeTensor",
    "FakeTensorMode",
    "disabled_torch_function",
    "is_fake",
    "log_softmax_backward",
    "flash_attention_cpu",
    "flash_attention_cpu_backward",
    "native_nn_functions",
    "add_batch_dim",
    "remove_batch_dim",
    "vmap_increment_nesting",
    "vmap_decrement_nesting",
    "aten_overloads",
    "autograd_inside_an_op",
    "make_wrapper_subclass",
    "c10d_functional",
    "checkpoint_context_fn",
    "copy_recompute_tag",
    "FakeTensorProp",
    "GraphAppendingTracer",
    "PythonReferenceAnalysis",
    "_register_process_group",
    "_resolve_process_group",
    "_unregister_process_group",
    "new_group_named",
    "aot_autograd",
    "compile_fx",
    "list_mode_options",
    "dynamo_counters",
    "register_fake_backend",
    "graph_break_reason",
    "first_line",
    "CHECKPOINTED_SIDE_EFFECTS",
    "checkpointed_side_effect_break",
    "ulysses_tracing",
    "honour_backend_contexts",
    "make_boxed_func",
    "op_name",
    "parameter_slots",
    "running_backward",
    "real_tensors",
    "recompute_region",
    "bind_symbols",
    "guards_hold",
    "symbol_hints",
    "symbol_lower_bounds",
    "symbolic_expr",
    "symbolic_hint",
    "tag_recompute",
    "live_bytes_peak",
    "CustomGraphPass",
    "OrderedSet",
    "bucket_all_gather_by_mb",
    "bucket_all_reduce_by_mb",
    "bucket_cap_mb_by_bucket_idx_default",
    "bucket_reduce_scatter_by_mb",
    "get_hash_for_files",
    "is_all_gather_into_tensor",
    "is_wait_tensor",
    "merge_all_gather",
    "preserve_node_ordering",
    "orig_code_map",
    "aliases_first_input",
    "min_cut_rematerialization_partition",
    "copy_graph",
    "no_graph_cse",
    "run_and_get_code",
    "statically_known_true",
    "free_unbacked_symbols",
    "GuardOnDataDependentSymNode",
    "sympy_interp",
    "trace_structured",
    "tree_leaves",
    "tree_map",
]

import copy  # noqa: E402
import functools  # noqa: E402

import torch  # noqa: E402

c10d_functional = torch.ops._c10d_functional
disabled_torch_function = torch._C._disabled_torch_function_impl
log_softmax_backward = torch.ops.aten._log_softmax_backward_data
# SDPA's flash kernel for CPU and its backward: the only CPU attention that returns the log-sum-exp
flash_attention_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
flash_attention_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
native_nn_functions = torch._C._nn  # where Dynamo records F.linear, F.gelu, ...
# vmap's entry and exit as Dynamo records them (torch's generic associative_scan vmaps its combine)
from torch._functorch.predispatch import _add_batch_dim as add_batch_dim  # noqa: E402
from torch._functorch.predispatch import _remove_batch_dim as remove_batch_dim  # noqa: E402
from torch._functorch.predispatch import _vmap_decrement_nesting as vmap_decrement_nesting  # noqa: E402
from torch._functorch.predispatch import _vmap_increment_nesting as vmap_increment_nesting  # noqa: E402


def make_wrapper_subclass(cls, shape, like: torch.Tensor):
    """A tensor of class ``cls`` and shape ``shape`` with ``like``'s dtype and device and no storage of
    its own (a ``__torch_dispatch__`` subclass holding other tensors)."""
    return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=like.dtype, device=like.device,
                                               layout=like.layout, requires_grad=False)


def autograd_inside_an_op():
    """A context in which a custom op's implementation records autograd again: the dispatcher runs the
    implementation with the autograd keys excluded, so a recompute inside it would record nothing."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for name, key in torch._C.DispatchKey.__members__.items():
        if name.startswith("Autograd"):
            exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def process_group_timeout(group) -> str:
    """How long the group's collectives wait for the other ranks (its CPU backend's option)."""
    try:
        return str(group._get_backend(torch.device("cpu")).options._timeout)
    except (RuntimeError, AttributeError):
        return "see init_process_group(timeout=...)"


def copy_graph(graph: "torch.fx.Graph") -> "torch.fx.Graph":
    """A deep copy of a Dynamo graph whose placeholders keep the source Dynamo recorded on each (a
    node attribute ``deepcopy`` drops, which AOTAutograd reads)."""
    copied = copy.deepcopy(graph)
    for node, copy_of_node in zip(graph.find_nodes(op="placeholder"), copied.find_nodes(op="placeholder")):
        if hasattr(node, "_dynamo_source"):
            copy_of_node._dynamo_source = node._dynamo_source
    return copied


def no_graph_cse():
    """A context in which AOTAutograd's partitioner does not merge equal nodes. Ranks' graphs may differ
    in structure (a position read on one rank is a view there and a fresh zero block elsewhere), so two
    equal collectives merged on one rank only would make the ranks meet out of step."""
    from torch._functorch import config

    return config.patch(cse=False)


def op_name(node) -> str | None:
    """``namespace::name`` of the torch op a graph node calls (``flash_attn::_flash_attn_forward``)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return None
    return target.name() if isinstance(target, torch._ops.OpOverload) else target._qualified_op_name


def aten_overloads():
    """``(name, [(tags, argument names, return types) of each overload])`` for every ATen op."""
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            overloads = [getattr(packet, overload) for overload in packet.overloads()]
            yield name, [(set(op.tags), [argument.name for argument in op._schema.arguments],
                          [str(result.type) for result in op._schema.returns]) for op in overloads]


def aliases_first_input(target) -> bool:
    """Whether a torch op's result shares its first input's storage: a view, or an in-place op's
    ``self`` returned (schema alias annotations)."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    return target.is_view or (bool(returns) and returns[0].alias_info is not None)


def register_fake_backend() -> None:
    """Make ``init_process_group("fake", store=HashStore(), ...)`` available: a process group whose
    collectives only produce results of the right shapes, for compiling as rank r of P in one process.
    torch registers it when its test utilities are imported; the library does not import those."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import FakeProcessGroup

    if "FAKE" in dist.Backend._plugins:
        return

    def create(common_options, backend_options):
        return FakeProcessGroup._create_internal(common_options.group_rank, common_options.group_size,
                                                 backend_options)

    dist.Backend.register_backend(dist.Backend.FAKE, create, extended_api=True, devices=["cpu", "cuda"])


def symbolic_expr(size: torch.SymInt):
    """The sympy expression of a symbolic size (``s27 // 2``)."""
    return size.node.expr


def symbolic_hint(size: torch.SymInt) -> int:
    """The value a symbolic size has in the call being compiled."""
    return size.node.hint


def symbol_hints(size: torch.SymInt, symbols) -> dict:
    """The values of size symbols in the call being compiled, from ``size``'s shape environment. A size
    read from data (an unbacked symbol: a count ``.tolist()`` read) has none: it counts at the largest
    value its checks allow (the memory it may take), or, unbounded, at Inductor's own fallback for such
    sizes."""
    import sympy
    from torch._inductor import config as inductor_config

    shape_env = size.node.shape_env
    hints = {}
    for symbol in symbols:
        if symbol in shape_env.backed_var_to_val:
            hints[symbol] = shape_env.backed_var_to_val[symbol]
            continue
        upper = shape_env.var_to_range[symbol].upper
        hints[symbol] = int(upper) if isinstance(upper, sympy.Integer) else inductor_config.unbacked_symint_fallback
    return hints


def bind_symbols(size: torch.SymInt, placeholders, args) -> dict:
    """The size symbols of a graph's inputs (``placeholders``: fake tensors and SymInts of ``size``'s
    shape environment, None for anything else) bound to their values in ``args``."""
    return size.node.shape_env.bind_symbols(placeholders, args)


def guards_hold(size: torch.SymInt, placeholders, args) -> bool:
    """Whether every guard torch added while tracing and compiling a graph (its shape environment,
    that of ``size``) holds for inputs of the sizes and strides of ``args``."""
    return size.node.shape_env.evaluate_guards_for_args(placeholders, args)


def tag_recompute(node, policy, region: int) -> None:
    """Tag a joint-graph node as the partitioner reads activation checkpointing: recompute it in the
    backward (``policy``, a ``torch.utils.checkpoint.CheckpointPolicy``) as part of checkpointed region
    ``region``."""
    node.meta.update(recompute=policy, ac_graph_id=region)


def copy_recompute_tag(source, target) -> None:
    """Give ``target`` the checkpointing tag ``source`` has, if any."""
    if "ac_graph_id" in source.meta:
        tag_recompute(target, source.meta["recompute"], source.meta["ac_graph_id"])


def checkpoint_context_fn(body):
    """The ``context_fn`` of a checkpointed region's body (selective checkpointing), None for plain
    checkpointing."""
    return body.meta.get("_checkpoint_context_fn")


def recompute_region(node) -> int | None:
    """The checkpointed region a node was tagged with, None when it has none."""
    return node.meta.get("ac_graph_id")


def parameter_slots(module: torch.nn.Module) -> dict:
    """A module's own parameter dict, name -> parameter, written in place (registering a tensor that
    ``nn.Module.__setattr__`` would refuse, such as a DTensor in place of a Parameter)."""
    return module._parameters


def running_backward() -> bool:
    """Whether autograd is running a backward in this thread (a checkpointed region recomputed, a hook)."""
    return torch._C._current_graph_task_id() != -1


def graph_break_reason(gm) -> str:
    """The first line of why Dynamo ended the graph being compiled at a graph break; "" where it ended at
    a return."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not reason.graph_break:
        return ""
    return first_line(reason.reason) or "a graph break"


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


CHECKPOINTED_SIDE_EFFECTS = "skip_fwd_side_effects_in_bwd_under_checkpoint"


def checkpointed_side_effect_break() -> str:
    """The first line of a graph break Dynamo recorded in this process at Python state mutated inside a
    higher-order op (a checkpointed region), "" if none or if such regions are now traced whole: the code
    around the break runs outside the compiled graphs, and the graphs compiled after it do not carry the
    reason."""
    if getattr(torch._dynamo.config, CHECKPOINTED_SIDE_EFFECTS):
        return ""
    for reason in map(first_line, dynamo_counters["graph_break"]):
        if reason.startswith("HOP:") and "side effect" in reason:
            return reason
    return ""


def ulysses_tracing():
    """Dynamo's settings for the calls of a model compiled with this backend.

    A checkpointed region whose Python code mutates state from outside it is traced into the graph
    rather than breaking the graph there: the mutation runs once per call, where eager checkpointing
    runs it again in the backward's recomputation. transformers 5.25's kernel hub sets and restores a
    context variable in every attention call, so without it every checkpointed decoder layer leaves the
    graph.

    Scalars read from tensors (``.item()``, ``.tolist()``) are captured as unbacked symbolic ints rather
    than breaking the graph: an MoE's per-expert token counts read with ``.tolist()`` (torchtitan's)
    stay in one graph, where each rank splits its own sorted rows at its own counts, and no count is
    specialized (a graph after a break would recompile where a count first hits 0 or 1, on one rank
    alone once the counts are the rank's)."""
    return torch._dynamo.config.patch(**{CHECKPOINTED_SIDE_EFFECTS: True, "capture_scalar_outputs": True})


def honour_backend_contexts() -> None:
    """Make ``torch.compile(fn, backend=B)`` enter ``B.backend_ctx_ctor()`` around every call of the
    compiled ``fn``, as ``torch._dynamo.optimize(B)`` does. Dynamo reads the attribute from the backend it
    is given (eval_frame.py), but torch.compile hands it a ``_TorchCompileWrapper`` of ``B`` that drops it
    (torch 2.13 and 2.14). Backends without the attribute, Inductor's and every other one torch ships, are
    unaffected; a third-party backend that defines one gets it entered from then on, as torch documents.
    Idempotent."""
    from torch._dynamo import eval_frame

    lookup = eval_frame.get_compiler_fn
    if getattr(lookup, "forwards_backend_context", False):
        return

    @functools.wraps(lookup)
    def get_compiler_fn(compiler_fn):
        wrapped = lookup(compiler_fn)
        if isinstance(compiler_fn, torch._TorchCompileWrapper) and not hasattr(wrapped, "backend_ctx_ctor"):
            context = getattr(compiler_fn.compiler_fn, "backend_ctx_ctor", None)
            if context is not None:
                wrapped.backend_ctx_ctor = context
        return wrapped

    get_compiler_fn.forwards_backend_context = True
    eval_frame.get_compiler_fn = get_compiler_fn


def buffer_slots(module: torch.nn.Module) -> dict:
    """A module's own buffer dict, name -> buffer, written in place."""
    return module._buffers


def symbol_lower_bounds(size: torch.SymInt, symbols) -> dict:
    """The least value each size symbol may take (2 for a length Dynamo made symbolic), None where torch
    has no range for it, from ``size``'s shape environment."""
    ranges = size.node.shape_env.var_to_range
    return {symbol: ranges[symbol].lower if symbol in ranges else None for symbol in symbols}


def real_tensors():
    """A context in which new tensors are real even inside a ``FakeTensorMode`` (explain on meta weights)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def version_counter(tensor: torch.Tensor) -> int:
    """How many in-place writes autograd has counted on ``tensor`` (shared by its views)."""
    return tensor._version


def live_bytes_peak(profile) -> int:
    """The most bytes of tensors alive at once while ``profile`` (``profile_memory=True``) recorded,
    counting only what was allocated while it recorded: the profiler's allocation events carry the
    allocator's running total of those bytes (on CPU a total the process keeps across recordings: the
    figure is exact for its first memory-profiled recording)."""
    from torch._C._profiler import _EventType

    def walk(events):
        for event in events:
            yield event
            yield from walk(event.children)

    totals = [event.extra_fields.total_allocated for event in walk(profile.profiler.kineto_results.experimental_event_tree())
              if event.tag == _EventType.Allocation]
    return max(totals, default=0)


def new_group_named(ranks: list[int], name: str):
    """A process group of the global ``ranks`` (this rank among them) under ``name``, created by its
    members alone. torch's ``new_group(ranks, use_local_synchronization=True)`` names a group by its
    ranks and the number of groups this process made before, which differs between ranks whose
    histories differ (a group of some ranks only, made earlier), and members under different names
    never meet; here the name, and so the store the members meet in, is the caller's, the same on
    every member."""
    default = distributed_c10d._get_default_group()
    backend, store = distributed_c10d._world.pg_map[default]
    group, _ = distributed_c10d._new_process_group_helper(
        len(ranks), ranks.index(default.rank()), ranks, backend, store, name,
        timeout=distributed_c10d._get_default_timeout(distributed_c10d.Backend(backend)),
        device_id=default.bound_device_id)
    distributed_c10d._world.pg_group_ranks[group] = {rank: index for index, rank in enumerate(ranks)}
    return group


def flattened_mesh(mesh, dims: tuple[str, ...]):
    """The one-dim mesh over ``mesh``'s dims ``dims`` together, named ``"_".join(dims)`` (DeviceMesh's
    ``_flatten``; made once per root mesh, by every rank)."""
    return mesh[dims]._flatten("_".join(dims))
