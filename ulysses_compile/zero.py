"""ZeRO-partitioned parameters inside the compiled graph, composed with sequence parallelism.

``parallelize(model, zero_stage=3)`` replaces every parameter by this rank's shard of it (a flat 1/N of
the padded parameter, N = every rank of the group or mesh) and returns the model compiled with the
ulysses backend. The modules still read ``module.weight``: a parametrization gathers the full weight
from the shards where the model uses it, so the gather is a call in the captured graph.

A Dynamo graph of ``linear(x, self.weight)`` before and after ``parallelize``::

    linear = torch._C._nn.linear(x, l_self_weight)

    weight = gather_parameter(l_self_parametrizations_weight_original, shape=(64, 64), numel=4096,
                              group_name='0', group_size=2)
    linear = torch._C._nn.linear(x, weight)

The gather's backward reduce-scatters the gradient straight into the shards, averaged over the
data-parallel replicas, so ``model.parameters()`` are the shards, their ``.grad`` the shards' gradients,
and any ``torch.optim`` optimizer built afterwards keeps its state partitioned.

``sharded_state_dict`` shows each shard to ``torch.distributed.checkpoint`` as a DTensor: rank r's part of
the flattened parameter (global shape ``(numel,)``, ``Shard(0)``, the last blocks shorter or empty), a
view of the live shard, so every rank saves and loads only its own part, in place.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.utils import parametrize
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .collectives import gather_parameter, gather_shards, padded_flat
from .compat import _init_optim_state, _resolve_process_group
from .errors import OptionsError, UlyssesError, UnsupportedError
from .options import Options

ZERO_STAGES = (0, 1, 2, 3)
_RETIRED = WeakIdKeyDictionary()  # the full parameters parallelize replaced; an optimizer must not hold them


class _GatheredParameter(nn.Module):
    """The parametrization: shard -> full parameter (and, for ``right_inverse``, full -> shard)."""

    def __init__(self, shape: torch.Size, group: dist.ProcessGroup, regather_in_backward: bool,
                 param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None):
        super().__init__()
        self.shape, self.numel = tuple(shape), shape.numel()
        self.group_name, self.group_size, self.rank = group.group_name, group.size(), group.rank()
        self.regather_in_backward = regather_in_backward
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        return gather_parameter(shard, self.shape, self.numel, self.group_name, self.group_size,
                                self.regather_in_backward, self.param_dtype, self.reduce_dtype)

    def right_inverse(self, full: torch.Tensor) -> torch.Tensor:
        return padded_flat(full.detach(), self.group_size).chunk(self.group_size)[self.rank].clone()

    def as_dtensor(self, shard: torch.Tensor) -> DTensor:
        """``shard`` (or optimizer state shaped like it) as its part of the flattened parameter."""
        held = max(0, min(shard.numel(), self.numel - self.rank * shard.numel()))
        mesh = DeviceMesh.from_group(_resolve_process_group(self.group_name), shard.device.type)
        return DTensor.from_local(shard.detach()[:held], mesh, [Shard(0)], run_check=False,
                                  shape=(self.numel,), stride=(1,))


def parallelize(model: nn.Module, *, zero_stage: int, group=None, mesh=None, param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = None, **options):
    """Partition ``model``'s parameters ZeRO-style over the group (or every rank of the mesh) and return
    it compiled with the ulysses backend and ``options``. Build the optimizer afterwards, from the
    returned model. ``param_dtype`` (mixed precision): gather and compute parameters in this dtype while
    the shards, gradients and optimizer state keep theirs; ``reduce_dtype``: the gradients' reduce-scatter
    dtype (default ``param_dtype``)."""
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
    zero_group = _zero_group(Options.parse(options))
    partitioned = zero_stage > 0 and zero_group is not None and zero_group.size() > 1
    if (param_dtype or reduce_dtype) and not partitioned:
        raise OptionsError(
            "param_dtype/reduce_dtype apply where ZeRO gathers and reduce-scatters parameters, and here none "
            f"is partitioned (zero_stage={zero_stage}, "
            f"{'no process group' if zero_group is None else f'{zero_group.size()} rank(s)'}); use zero_stage 1-3 "
            f"on several ranks, or torch.autocast"
        )
    if partitioned:
        _partition(model, zero_group, zero_stage == 3, param_dtype, reduce_dtype or param_dtype)
    if param_dtype is not None:
        model.register_forward_pre_hook(functools.partial(_cast_floating_inputs, param_dtype), with_kwargs=True)
    model._ulysses_zero_stage = zero_stage
    return torch.compile(model, backend="ulysses", options=options)


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


def _partition(model: nn.Module, group: dist.ProcessGroup, regather_in_backward: bool, param_dtype, reduce_dtype):
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    originals: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules():
        if parametrize.is_parametrized(module):
            raise UnsupportedError(
                f"{module_name or type(model).__name__} already has parametrizations "
                f"({', '.join(module.parametrizations)}); parallelize shards parameters with a parametrization "
                f"of its own, so remove them first (e.g. torch.nn.utils.parametrize.remove_parametrizations)"
            )
        for name, param in module._parameters.items():  # each name, also of a parameter held twice
            if param is None:
                continue
            owners.setdefault(id(param), []).append((module, name))
            originals[id(param)] = param
    for key, places in owners.items():
        param = originals[key]
        gather = _GatheredParameter(param.shape, group, regather_in_backward, param_dtype, reduce_dtype)
        shard = None
        for module, name in places:  # a tied parameter (embedding and lm_head) keeps one shard
            # Registering turns the attribute's tensor into the shard in place; a copy is registered,
            # so the user's parameter objects stay as they were and an optimizer holding them is caught.
            module._parameters[name] = nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
            parametrize.register_parametrization(module, name, gather, unsafe=True)
            holder = module.parametrizations[name]
            if shard is None:
                shard = holder.original
            else:
                holder.original = shard
        _RETIRED[param] = True


def _refuse_retired_parameters(optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        if any(param in _RETIRED for param in group["params"]):
            raise UlyssesError(
                f"{type(optimizer).__name__} holds parameters that parallelize() replaced by their shards, so "
                f"its steps would update tensors the model no longer uses; build the optimizer after "
                f"parallelize, from the parallelized model's parameters()"
            )


register_optimizer_step_pre_hook(_refuse_retired_parameters)


def _named_state(model: nn.Module):
    """``(name, tensor, gather)`` for every parameter and persistent buffer under its unparallelized
    name; ``tensor`` is the shard and ``gather`` its parametrization for a partitioned parameter."""
    model = getattr(model, "_orig_mod", model)
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for name, holder in getattr(module, "parametrizations", {}).items():
            (gather,) = holder
            yield prefix + name, holder.original, gather
        if isinstance(module, parametrize.ParametrizationList):
            continue
        for name, param in module._parameters.items():
            if param is not None:
                yield prefix + name, param, None
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                yield prefix + name, buffer, None


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state with full tensors under the unparallelized names (``lm_head.weight``, not its
    shard), on every rank; for saving or comparing."""
    return {
        name: tensor.detach() if gather is None else
        gather_shards(tensor.detach(), gather.shape, gather.numel, gather.group_name, gather.group_size)
        for name, tensor, gather in _named_state(model)
    }


def sharded_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """``{"model": ..., "optimizer": ...}`` for ``torch.distributed.checkpoint.save`` / ``load``: names
    as in the unparallelized model, each ZeRO shard (and the optimizer state of it) a DTensor viewing
    this rank's part of the flattened tensor, everything else as it is. The tensors are the live ones,
    so ``dcp.load`` restores them in place; then call :func:`load_sharded_state_dict` for the rest.
    An optimizer that has not stepped yet gets its state created first (a step with zero gradients
    and learning rate, as ``torch.distributed.checkpoint.state_dict`` does)."""
    state = {"model": {name: _checkpointed(tensor, tensor, gather) for name, tensor, gather in _named_state(model)}}
    if optimizer is not None:
        state["optimizer"] = _optimizer_state(model, optimizer)
    return state


def _optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    _init_optim_state(optimizer)
    names, gathers = {}, {}
    for name, tensor, gather in _named_state(model):
        names.setdefault(id(tensor), name)  # a tied shard is named after its first owner
        gathers[id(tensor)] = gather
    per_param, groups = {}, []
    for group in optimizer.param_groups:
        group_names = []
        for param in group["params"]:
            if id(param) not in names:
                raise UlyssesError(
                    f"{type(optimizer).__name__} holds a tensor of shape {tuple(param.shape)} that is not a "
                    f"parameter of the model; build the optimizer from the parallelized model's parameters()"
                )
            name, gather = names[id(param)], gathers[id(param)]
            group_names.append(name)
            per_param[name] = {key: _checkpointed(value, param, gather, f"{type(optimizer).__name__} state {key!r} "
                                                  f"of {name}")
                               for key, value in optimizer.state.get(param, {}).items()}
        groups.append({**{key: value for key, value in group.items() if key != "params"}, "params": group_names})
    return {"state": per_param, "param_groups": groups}


def _checkpointed(value, param: torch.Tensor, gather: _GatheredParameter | None, what: str = ""):
    """How a parameter, or a value of optimizer state, is checkpointed: a tensor shaped like the parameter
    flat (a DTensor of its part when sharded), so one checkpoint loads at any number of ranks; a 0-d
    tensor or any other value as it is (the same on every rank)."""
    if not isinstance(value, torch.Tensor) or (value.dim() == 0 and param.dim() > 0):
        return value
    if value.shape != param.shape:
        raise UlyssesError(
            f"{what} has shape {tuple(value.shape)}, neither the parameter's {tuple(param.shape)} nor a "
            f"scalar, so it cannot be saved by part; sharded checkpoints support optimizers whose "
            f"state is per element (Adam, AdamW, SGD, ...)"
        )
    return value.detach().view(-1) if gather is None else gather.as_dtensor(value)


def load_sharded_state_dict(model: nn.Module, state: dict, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Put ``state`` (from :func:`sharded_state_dict`, filled by ``dcp.load``) into the model and the
    optimizer: tensors copied into the live shards where ``dcp.load`` did not write in place, and the
    optimizer's hyperparameters restored."""
    if optimizer is not None and "optimizer" not in state:
        raise UlyssesError("the state holds no optimizer state: pass the optimizer to sharded_state_dict too")
    live = sharded_state_dict(model, optimizer)
    _copy_tensors("model", live["model"], state["model"])
    if optimizer is None:
        return
    saved = state["optimizer"]
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise UlyssesError(f"the state holds {len(saved['param_groups'])} optimizer param groups, the optimizer "
                           f"{len(optimizer.param_groups)}; build the optimizer as the one that was saved")
    for group, saved_group, live_group in zip(optimizer.param_groups, saved["param_groups"],
                                              live["optimizer"]["param_groups"]):
        if list(saved_group["params"]) != live_group["params"]:
            raise UlyssesError(f"an optimizer param group holds {live_group['params']}, the saved one "
                               f"{list(saved_group['params'])}; build the optimizer as the one that was saved")
        for param, name in zip(group["params"], live_group["params"]):
            _copy_tensors(f"optimizer state of {name}", live["optimizer"]["state"][name],
                          saved["state"].get(name, {}), optimizer.state[param])
        group.update({key: value for key, value in saved_group.items() if key != "params"})


def _copy_tensors(what: str, live: dict, saved: dict, values: dict | None = None) -> None:
    """Copy ``saved``'s tensors into ``live``'s (views of the model's or optimizer's; a no-op where
    ``dcp.load`` wrote in place); other saved values go into ``values``."""
    if sorted(live) != sorted(saved):
        raise UlyssesError(
            f"{what}: the state holds {sorted(set(saved) - set(live)) or 'no'} unexpected and misses "
            f"{sorted(set(live) - set(saved)) or 'no'} entries; load a state saved from the same model"
        )
    with torch.no_grad():
        for name, target in live.items():
            value = saved[name]
            if not isinstance(target, torch.Tensor):
                values[name] = value
                continue
            if isinstance(target, DTensor):
                target, value = target.to_local(), value.to_local()
            if target.data_ptr() != value.data_ptr():
                target.copy_(value)
