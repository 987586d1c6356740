"""ZeRO-partitioned parameters inside the compiled graph, composed with sequence parallelism.

``parallelize(model, zero_stage=3)`` replaces every parameter by a DTensor of its original shape,
sharded on dim 0 over every rank of the group or mesh (N = data x sequence ranks), as FSDP2 and
torchtitan's SimpleFSDP lay parameters out, and returns the model compiled with the ulysses backend.
``named_parameters()``, ``state_dict()`` and the optimizer see these DTensors under their original names,
so torch's own ``clip_grad_norm_``, ``p.dim()``-based weight-decay groups, ``get_state_dict`` /
``set_state_dict`` and ``torch.distributed.checkpoint`` (resharding at another number of ranks) work
as they do for FSDP2. The modules still read ``module.weight``: each module's class gets a property per
parameter (a subclass made for that module) that, during a call of the returned model, gathers the
full weight from the shards, so the gather is a call in the captured graph; read anywhere else it is
the DTensor parameter, as FSDP2's modules hold it between steps (``.full_tensor()`` gathers it).

The graph takes each parameter's local rows, not the DTensor: a hook of the returned model unwraps
them (``to_local``, padded to equal blocks) before every call, outside the compiled code. A DTensor
input would make the device mesh an input of the graph, and AOTAutograd (torch 2.13) misorders it
among the saved values when a checkpointed region holds a random op (SDPA is one).

A Dynamo graph of ``linear(x, self.weight)`` before and after ``parallelize``::

    linear = torch._C._nn.linear(x, l_self_weight)

    weight = gather_parameter(l_self_ulysses_shards_weight_, shape=(64, 64), group_name='0', group_size=2)
    linear = torch._C._nn.linear(x, weight)

The gather's backward reduce-scatters the gradient straight into the shard, averaged over the
data-parallel replicas, so each parameter's ``.grad`` is a DTensor sharded like it and any
``torch.optim`` optimizer built afterwards keeps its state partitioned.
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.utils import parametrize
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from ulysses_compile.agreement import agree_on_module_state
from ulysses_compile.core.collectives import gather_parameter
from ulysses_compile.core.compat import ulysses_tracing, honour_backend_contexts, parameter_slots, running_backward
from ulysses_compile.core.errors import OptionsError, UlyssesError, UnsupportedError
from ulysses_compile.core.options import Options
from ulysses_compile.core.sharding import SHARDS, shard_rows

ZERO_STAGES = (0, 1, 2, 3)
_RETIRED = WeakIdKeyDictionary()  # the full parameters parallelize replaced; an optimizer must not hold them
GATHERS = "_ulysses_gathers"  # module.__dict__ entry: parameter name -> how the module reads it


class _Gather:
    """How a module reads one partitioned parameter: its shard -> the full tensor."""

    def __init__(self, name: str, shape: torch.Size, group: dist.ProcessGroup, regather_in_backward: bool,
                 param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None):
        self.name, self.shape = name, tuple(shape)
        self.group_name, self.group_size = group.group_name, group.size()
        self.regather_in_backward = regather_in_backward
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype

    def __call__(self, module: nn.Module) -> torch.Tensor:
        local = module.__dict__[SHARDS].get(self.name)
        if local is None:
            param = parameter_slots(module)[self.name]
            if not (running_backward() and torch.is_grad_enabled()):
                return param  # outside a step (state dicts, shapes, backward hooks): the DTensor, as FSDP2's
            # a checkpointed region Dynamo ran eagerly, recomputed in the backward: gathered as in a step
            local = padded_shard(param, self.group_size)
        return gather_parameter(local, self.shape, self.group_name, self.group_size, self.regather_in_backward,
                                self.param_dtype, self.reduce_dtype)


def _as_dtensor(param: nn.Parameter, mesh: DeviceMesh) -> nn.Parameter:
    """``param`` as a DTensor of its shape, this rank's rows of dim 0 (torch.chunk's blocks, as DTensor
    and FSDP2 cut them: 5 rows on 4 ranks are 2, 2, 1, 0); a 0-d parameter is replicated."""
    full = param.detach()
    if full.dim() == 0:
        local, placements = full.clone(), [Replicate()]
    else:
        start, rows = shard_rows(full.shape[0], mesh.size(), mesh.get_local_rank())
        local, placements = full.narrow(0, start, rows).clone(), [Shard(0)]
    sharded = DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())
    return nn.Parameter(sharded, requires_grad=param.requires_grad)


def parallelize(model: nn.Module, *, zero_stage: int, group=None, mesh=None, param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = None, **options):
    """Partition ``model``'s parameters ZeRO-style over the group (or every rank of the mesh) and return
    it compiled with the ulysses backend and ``options``. Build the optimizer afterwards, from the
    returned model. ``param_dtype`` (mixed precision): gather and compute parameters in this dtype while
    the shards, gradients and optimizer state keep theirs; ``reduce_dtype``: the gradients' reduce-scatter
    dtype (default ``param_dtype``). Checkpointed regions whose Python code mutates state from outside
    them (transformers 5.25's decoder layers) are traced whole: the mutation runs once per call, not
    again in the backward's recomputation."""
    return compile_partitioned(model, "ulysses", zero_stage=zero_stage, group=group, mesh=mesh,
                               param_dtype=param_dtype, reduce_dtype=reduce_dtype, options=options)


def compile_partitioned(model: nn.Module, backend, *, zero_stage: int, group, mesh, param_dtype, reduce_dtype,
                        options: dict, dynamic: bool | None = None):
    """:func:`parallelize` with a backend of the caller's: "ulysses", or ``explain``'s, which compiles
    the same partitioned model against a fake process group (``options`` then only configure the
    partitioning)."""
    if zero_stage not in ZERO_STAGES:
        raise OptionsError(f"zero_stage={zero_stage!r}: expected one of {list(ZERO_STAGES)} (DeepSpeed's stages)")
    if getattr(model, "_ulysses_zero_stage", None) is not None:
        raise UlyssesError(
            f"this model was already parallelized (zero_stage={model._ulysses_zero_stage}); call "
            f"parallelize once, on the unparallelized model"
        )
    for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise OptionsError(f"{name}={dtype!r}: expected a floating torch.dtype such as torch.bfloat16")
    if group is not None:
        options["group"] = group
    if mesh is not None:
        options["mesh"] = mesh
    parsed = Options.parse(options)
    zero_group = _zero_group(parsed)
    if zero_group is not None and zero_group.size() > 1:  # before any parameter is partitioned
        agree_on_module_state(dict(itertools.chain(model.named_parameters(), model.named_buffers())), zero_group,
                              zero_group.rank(), parsed.sync_module_states, "parallelize")
    partitioned = zero_stage > 0 and zero_group is not None and zero_group.size() > 1
    if (param_dtype or reduce_dtype) and not partitioned:
        raise OptionsError(
            "param_dtype/reduce_dtype apply where ZeRO gathers and reduce-scatters parameters, and here none "
            f"is partitioned (zero_stage={zero_stage}, "
            f"{'no process group' if zero_group is None else f'{zero_group.size()} rank(s)'}); use zero_stage 1-3 "
            f"on several ranks, or torch.autocast"
        )
    places = []
    if partitioned:
        _watch_optimizers()
        places = _partition(model, zero_group, zero_stage == 3, param_dtype, reduce_dtype or param_dtype)
    if param_dtype is not None:
        model.register_forward_pre_hook(functools.partial(_cast_floating_inputs, param_dtype), with_kwargs=True)
    model._ulysses_zero_stage = zero_stage
    # verify="short" runs the program at a short length: the length must be symbolic from the first call.
    dynamic = True if options.get("verify") == "short" else dynamic
    honour_backend_contexts()
    if not isinstance(backend, str):  # explain's: it traces what "ulysses" would, and reports it itself
        backend.backend_ctx_ctor = ulysses_tracing
    compiled = (torch.compile(model, backend=backend, dynamic=dynamic, options=options) if isinstance(backend, str)
                else torch.compile(model, backend=backend, dynamic=dynamic))
    if places:
        shards = _LocalShards(places, zero_group.size())
        compiled.register_forward_pre_hook(lambda module, args: shards.expose(compiled))
        compiled.register_forward_hook(lambda module, args, output: shards.hide(compiled), always_call=True)
        # Eager calls of the model itself (generate() calls it, not the compiled wrapper); inside the
        # compiled code these hooks are traced and do nothing.
        model.register_forward_pre_hook(lambda module, args: None if torch.compiler.is_compiling()
                                        else shards.expose(model))
        model.register_forward_hook(lambda module, args, output: None if torch.compiler.is_compiling()
                                    else shards.hide(model), always_call=True)
    return compiled


class _LocalShards:
    """Hands the modules every parameter's local rows for one call of the model, outside the compiled
    code: padded to the largest block, so the graph takes plain tensors of one shape on every rank, and
    autograd carries their gradients back into the DTensors' ``.grad``. Between calls the modules read
    the DTensors."""

    def __init__(self, places: list[tuple[nn.Module, str]], group_size: int):
        self.places, self.group_size = places, group_size
        self.owner = None  # the caller that exposed them: the compiled wrapper, or an eager call

    def expose(self, owner) -> None:
        if self.owner is not None:
            return
        self.owner = owner
        local: dict[int, torch.Tensor] = {}
        for module, name in self.places:
            param = parameter_slots(module)[name]
            if id(param) not in local:
                local[id(param)] = padded_shard(param, self.group_size)
            module.__dict__[SHARDS][name] = local[id(param)]

    def hide(self, owner) -> None:
        if self.owner is not owner:
            return
        self.owner = None
        for module, name in self.places:
            module.__dict__[SHARDS].pop(name, None)


def padded_shard(param: DTensor, group_size: int) -> torch.Tensor:
    """This rank's rows of a partitioned parameter, padded to the largest block (``gather_parameter``'s
    input); autograd carries their gradient into the DTensor's ``.grad``."""
    local = param.to_local(grad_placements=param.placements)
    if param.dim() == 0:
        return local
    rows = -(-param.shape[0] // group_size)
    if local.shape[0] == rows:  # an even block stays a view; padding copies
        return local
    return nn.functional.pad(local, [0, 0] * (local.dim() - 1) + [0, rows - local.shape[0]])


def _cast_floating_inputs(dtype: torch.dtype, module, args, kwargs):
    """Floating-point inputs in the parameters' compute dtype, as FSDP's mixed precision casts them."""
    def cast(value):
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    return tuple(map(cast, args)), {key: cast(value) for key, value in kwargs.items()}


def _zero_group(opts: Options):
    """Every rank that holds a model replica's data: the whole mesh, or the sequence-parallel group."""
    if opts.mesh is None:
        return opts.process_group()
    ranks = opts.mesh.mesh.flatten().tolist()
    return dist.group.WORLD if len(ranks) == dist.get_world_size() else dist.new_group(ranks)


def _partition(model: nn.Module, group: dist.ProcessGroup, regather_in_backward: bool, param_dtype,
               reduce_dtype) -> list[tuple[nn.Module, str]]:
    """Every parameter as a DTensor of its shape; returns where each is read, ``(module, name)``."""
    device = next(model.parameters(), torch.empty(0)).device
    mesh = DeviceMesh.from_group(group, device.type)
    sharded: dict[int, nn.Parameter] = {}
    places = []
    for module_name, module in model.named_modules():
        if parametrize.is_parametrized(module):
            raise UnsupportedError(
                f"{module_name or type(model).__name__} already has parametrizations "
                f"({', '.join(module.parametrizations)}); parallelize reads parameters through properties of "
                f"its own, so remove them first (e.g. torch.nn.utils.parametrize.remove_parametrizations)"
            )
        gathers = {}
        for name, param in parameter_slots(module).items():  # each name, also of a parameter held twice
            if param is None:
                continue
            if id(param) not in sharded:  # a tied parameter (embedding and lm_head) keeps one DTensor
                sharded[id(param)] = _as_dtensor(param, mesh)
                _RETIRED[param] = True
            parameter_slots(module)[name] = sharded[id(param)]
            gathers[name] = _Gather(name, param.shape, group, regather_in_backward, param_dtype, reduce_dtype)
        if gathers:
            _read_through(module, gathers)
            module.__dict__[SHARDS] = {}
            places += [(module, name) for name in gathers]
    return places


def _read_through(module: nn.Module, gathers: dict[str, _Gather]) -> None:
    """Give ``module`` a class whose properties return the gathered parameters, leaving the DTensors in
    the module's parameter slots under their names (torch.nn.utils.parametrize would rename them
    ``parametrizations.<name>.original``). The class is shared by every module of one class and
    parameter names: a class of its own per module would fail Dynamo's type guards on each model
    parallelized in a process, and after torch's recompile limit (8) its calls would run eagerly."""
    module.__dict__[GATHERS] = gathers
    module.__class__ = _reading_class(type(module), tuple(gathers))


@functools.cache
def _reading_class(cls: type, names: tuple[str, ...]) -> type:
    return type(f"Parallelized{cls.__name__}", (cls,), {name: property(_reader(name)) for name in names})


def _reader(name: str):
    def read(module: nn.Module) -> torch.Tensor:
        return module.__dict__[GATHERS][name](module)

    return read


@functools.cache
def _watch_optimizers():
    return register_optimizer_step_pre_hook(_refuse_retired_parameters)


def _refuse_retired_parameters(optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        if any(param in _RETIRED for param in group["params"]):
            raise UlyssesError(
                f"{type(optimizer).__name__} holds parameters that parallelize() replaced by their shards, so "
                f"its steps would update tensors the model no longer uses; build the optimizer after "
                f"parallelize, from the parallelized model's parameters()"
            )



def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state with full tensors under the unparallelized names, on every rank; for comparing
    or for a small model. To save, use :func:`save_pretrained` (rank 0 alone holds the full tensors) or
    ``torch.distributed.checkpoint`` with torch's ``get_state_dict`` (each rank writes its shards)."""
    return get_model_state_dict(getattr(model, "_orig_mod", model), options=StateDictOptions(full_state_dict=True))


def save_pretrained(model: nn.Module, path, **kwargs) -> None:
    """A parallelized transformers model saved as a normal Hugging Face checkpoint that
    ``from_pretrained`` loads on one process: the parameters are gathered one at a time and kept on rank
    0 alone, which writes ``path``; every rank must call it. ``kwargs`` go to ``save_pretrained``."""
    module = getattr(model, "_orig_mod", model)
    if not dist.is_initialized():
        module.save_pretrained(path, **kwargs)
        return
    sharded = next((p for p in module.parameters() if isinstance(p, DTensor)), None)
    group = sharded.device_mesh.get_group() if sharded is not None else dist.group.WORLD
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank(group) == 0:
        module.save_pretrained(path, state_dict=state, **kwargs)
    dist.barrier(group)
