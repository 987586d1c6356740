"""Where a compiled graph's outputs meet the user's code: with ``outputs="dtensor"``, sequence-sharded
outputs leave as DTensors.

A graph output the rewrite leaves sharded along one dim (the logits ``[B, S, V]`` at ``Shard(1)``) is
then returned as a ``DTensor`` of the global shape, sharded on that dim over the sequence-parallel
ranks (a one-dim mesh named ``"sp"``). Nothing is gathered unless the user asks (``.full_tensor()``),
so a loop that reads ``.loss`` never holds the whole ``[S, V]`` logits, and per-token log-probabilities
computed from them with DTensor's rules (``log_softmax``, ``gather``) stay on the rank's tokens. The
value follows DTensor's semantics, not a plain tensor's: mixing it with a plain tensor is DTensor's
error, and a reduction is ``Partial`` until redistributed (DTensor's ``.item()`` of it is the rank's own
term). That is why it is an option and not the default (docs/how-it-works.md, "Outputs").

Only outputs that go straight to the ``torch.compile`` caller leave as DTensors
(``compat.returns_to_compile_caller``). A value crossing a graph break is read by eager code or by the
next graph, whose other tensors are plain: Dynamo traces a DTensor input with DTensor's rules and
refuses to mix it with a plain parameter, so such values are gathered, as are outputs of uneven blocks
(DTensor's ``Shard`` holds ``torch.chunk``'s blocks, ours are balanced; the two agree where P divides
the length) and outputs sharded over merged dims (``[B*S, V]``), which no DTensor placement describes.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard as DTensorShard

from .compat import statically_known_true
from .errors import UnsupportedError
from .sizes import is_symbolic


def even_blocks(length, world_size: int) -> bool:
    """Whether P divides the length for every call of the graph (a symbolic length's remainder mod P is
    pinned by its class guard, ``sizes.pin_length_class``)."""
    if not is_symbolic(length):
        return length % world_size == 0
    return statically_known_true(length % world_size == 0)


def as_dtensors(compiled, sharded_outputs: dict[int, int], mesh_of):
    """``compiled`` with its sequence-sharded outputs (position -> dim) returned as DTensors on
    ``mesh_of(device_type)``."""
    if not sharded_outputs:
        return compiled

    def run(*args):
        outputs = list(compiled(*args))
        for position, dim in sharded_outputs.items():
            local = outputs[position]
            outputs[position] = DTensor.from_local(local, mesh_of(local.device.type), [DTensorShard(dim)],
                                                   run_check=False)
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
