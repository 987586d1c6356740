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
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.utils import parametrize
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from .collectives import gather_parameter, gather_shards, padded_flat
from .errors import OptionsError, UlyssesError
from .options import Options

ZERO_STAGES = (0, 1, 2, 3)
_RETIRED = WeakIdKeyDictionary()  # the full parameters parallelize replaced; an optimizer must not hold them


class _GatheredParameter(nn.Module):
    """The parametrization: shard -> full parameter (and, for ``right_inverse``, full -> shard)."""

    def __init__(self, shape: torch.Size, group: dist.ProcessGroup, regather_in_backward: bool):
        super().__init__()
        self.shape, self.numel = tuple(shape), shape.numel()
        self.group_name, self.group_size, self.rank = group.group_name, group.size(), group.rank()
        self.regather_in_backward = regather_in_backward

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        return gather_parameter(shard, self.shape, self.numel, self.group_name, self.group_size,
                                self.regather_in_backward)

    def right_inverse(self, full: torch.Tensor) -> torch.Tensor:
        return padded_flat(full.detach(), self.group_size).chunk(self.group_size)[self.rank].clone()


def parallelize(model: nn.Module, zero_stage: int = 3, *, group=None, mesh=None, options: dict | None = None):
    """Partition ``model``'s parameters ZeRO-style over the group (or every rank of the mesh) and return
    it compiled with the ulysses backend. Build the optimizer afterwards, from the returned model."""
    if zero_stage not in ZERO_STAGES:
        raise OptionsError(f"zero_stage={zero_stage!r}: expected one of {list(ZERO_STAGES)} (DeepSpeed's stages)")
    if getattr(model, "_ulysses_zero_stage", None) is not None:
        raise UlyssesError(
            f"this model was already parallelized (zero_stage={model._ulysses_zero_stage}); call "
            f"parallelize once, on the unparallelized model"
        )
    options = dict(options or {})
    if group is not None:
        options["group"] = group
    if mesh is not None:
        options["mesh"] = mesh
    opts = Options.parse(options)
    zero_group = _zero_group(opts)
    if zero_stage > 0 and zero_group is not None and zero_group.size() > 1:
        _partition(model, zero_group, regather_in_backward=zero_stage == 3)
    model._ulysses_zero_stage = zero_stage
    return torch.compile(model, backend="ulysses", options=options)


def _zero_group(opts: Options):
    """Every rank that holds a model replica's data: the whole mesh, or the sequence-parallel group."""
    if opts.mesh is None:
        return opts.process_group()
    ranks = opts.mesh.mesh.flatten().tolist()
    return dist.group.WORLD if len(ranks) == dist.get_world_size() else dist.new_group(ranks)


def _partition(model: nn.Module, group: dist.ProcessGroup, regather_in_backward: bool) -> None:
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    originals: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            owners.setdefault(id(param), []).append((module, name))
            originals[id(param)] = param
    for key, places in owners.items():
        param = originals[key]
        gather = _GatheredParameter(param.shape, group, regather_in_backward)
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


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state with full tensors under the unparallelized names (``lm_head.weight``, not its
    shard), on every rank; for saving or comparing."""
    model = getattr(model, "_orig_mod", model)
    state = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        holders = getattr(module, "parametrizations", {})
        for name, holder in holders.items():
            (gather,) = holder
            state[prefix + name] = gather_shards(holder.original.detach(), gather.shape, gather.numel,
                                                 gather.group_name, gather.group_size)
        for name, param in module.named_parameters(recurse=False):
            state[prefix + name] = param.detach()
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                state[prefix + name] = buffer.detach()
    return {key: value for key, value in state.items() if ".parametrizations." not in key}
