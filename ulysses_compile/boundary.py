"""Where a compiled graph's outputs meet the user's code: sequence-sharded outputs leave as
:class:`ShardedOutput`, the global tensor held as each rank's block.

With ``outputs="dtensor"`` (the default), a graph output the rewrite leaves sharded along one dim (the
logits ``[B, S, V]`` at ``Shard(1)``) is returned as a ``ShardedOutput``: a ``DTensor`` of the global
shape, sharded on that dim over the sequence-parallel ranks (``out.logits.device_mesh``, ``"sp"``).
Nothing is gathered unless an op needs it, so a user who reads ``.loss`` never holds the whole ``[S, V]``
logits, and per-token log-probabilities, entropies or KL terms computed from them stay on the rank's
tokens (``tests/test_sharded_outputs.py``).

It reads as the eager tensor does, where a bare DTensor would not:

- a plain tensor it meets is the same global value on every rank (the backend's contract: every rank
  passes the same inputs), so DTensor's implicit replication applies (``w * out.logits``);
- a reduction's partial sums are completed at once: a bare DTensor's ``.item()`` of a ``Partial`` value
  is the rank's own term, a different answer on each rank;
- an op DTensor has no rule for (``out.logits[mask]``), and ``tolist``/``numpy``, run on the gathered
  tensor and return plain tensors: the gather happens on that use.

``full_tensor()`` gathers it; ``to_local()`` is the rank's block.

Only outputs that go straight to the ``torch.compile`` caller leave this way
(``compat.returns_to_compile_caller``). A value crossing a graph break is read by eager code or by the
next graph, whose other tensors are plain: Dynamo traces a DTensor input with DTensor's rules and
refuses to mix it with a plain parameter, so such values are gathered, as are outputs of uneven blocks
(DTensor's ``Shard`` holds ``torch.chunk``'s blocks, ours are balanced; the two agree where P divides
the length) and outputs sharded over merged dims (``[B*S, V]``), which no DTensor placement describes.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import Shard as DTensorShard
from torch.distributed.tensor.experimental import implicit_replication

from .compat import dtensor_parts, mutates_arguments, statically_known_true, tree_map
from .errors import UnsupportedError
from .sizes import is_symbolic


def even_blocks(length, world_size: int) -> bool:
    """Whether P divides the length for every call of the graph (a symbolic length's remainder mod P is
    pinned by its class guard, ``sizes.pin_length_class``)."""
    if not is_symbolic(length):
        return length % world_size == 0
    return statically_known_true(length % world_size == 0)


class ShardedOutput(DTensor):
    """A model output as eager computes it, held as each rank's block of one dim (module docstring)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            with implicit_replication():
                result = super().__torch_dispatch__(func, types, args, kwargs)
        except (NotImplementedError, RuntimeError, IndexError) as refused:  # DTensor has no sharded form of this op
            if mutates_arguments(func):  # a write into a gathered copy would be lost
                raise UnsupportedError(
                    f"{func} writes into a model output held sharded over the sequence-parallel ranks (a "
                    f"ulysses_compile ShardedOutput), which has no sharded form; call .full_tensor() on it first, "
                    f"or compile with options={{'outputs': 'gather'}}"
                ) from refused
            return func(*tree_map(whole, args), **tree_map(whole, kwargs))
        return tree_map(_viewed, result)

    def tolist(self):
        return self.full_tensor().tolist()

    def numpy(self, *, force: bool = False):
        return self.full_tensor().numpy(force=force)


def whole(value):
    """A DTensor gathered (``full_tensor``); anything else as it is."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def _viewed(value):
    """An op's DTensor result as a ShardedOutput, its partial sums completed."""
    if type(value) is not DTensor:
        return value
    if any(placement.is_partial() for placement in value.placements):
        value = value.redistribute(placements=[Replicate() if placement.is_partial() else placement
                                               for placement in value.placements])
    local, spec = dtensor_parts(value)
    return ShardedOutput(local.detach(), spec, requires_grad=False)  # below autograd, which marks the result itself


class _AsShardedOutput(torch.autograd.Function):
    """The same DTensor as a ShardedOutput; its gradient passes as it comes."""

    @staticmethod
    def forward(ctx, value):
        local, spec = dtensor_parts(value)
        return ShardedOutput(local.detach(), spec, requires_grad=False)  # the Function connects it

    @staticmethod
    def backward(ctx, grad):
        return grad


def as_sharded_outputs(compiled, sharded_outputs: dict[int, int], mesh_of):
    """``compiled`` with its sequence-sharded outputs (position -> dim) returned as ShardedOutputs on
    ``mesh_of(device_type)``."""
    if not sharded_outputs:
        return compiled

    def run(*args):
        outputs = list(compiled(*args))
        for position, dim in sharded_outputs.items():
            local = outputs[position]
            value = DTensor.from_local(local, mesh_of(local.device.type), [DTensorShard(dim)], run_check=False)
            outputs[position] = _AsShardedOutput.apply(value)
        return outputs

    return run


def sequence_mesh(options, group):
    """The sequence-parallel ranks as a one-dim ``DeviceMesh`` named ``"sp"`` (made once per device type):
    the mesh option's ``"sp"`` dim, or one over ``group``."""
    meshes: dict[str, DeviceMesh] = {}

    def mesh_of(device_type: str) -> DeviceMesh:
        if device_type not in meshes:
            if options.mesh is not None and options.mesh.device_type == device_type:
                meshes[device_type] = options.mesh["sp"]
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
