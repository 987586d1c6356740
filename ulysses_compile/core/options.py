"""``torch.compile(model, backend="ulysses", options={...})``: the keys, their checks and defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any

import torch.distributed as dist

from ulysses_compile.core.collectives import mesh_group_name
from ulysses_compile.core.compat import flattened_mesh
from ulysses_compile.core.errors import OptionsError

COMPILERS = ("inductor", "aot_eager", "eager")
OUTPUT_MODES = ("lazy", "gather", "local", "dtensor")


@dataclass(frozen=True)
class Options:
    group: Any = None  # a ProcessGroup; None means the default group
    mesh: Any = None  # a DeviceMesh with a dim named "sp", optionally "dp" before it and "ring" (an "sp" of 1: DP only)
    outputs: str = "lazy"  # sequence-sharded outputs: gathered when read; "gather": in the graph; "local"; "dtensor"
    compiler: str = "inductor"
    verify: bool | str = False  # True: each graph's first call against eager; "short": the same on a short sequence
    dump_dir: str | None = None  # write each graph's code before and after every pass, and its report, here
    check_inputs: bool = True  # every call, compare the values of the user's inputs across the group
    tile_mlp: bool | str = "checkpointed"  # gated MLPs in chunks of rows: in checkpointed layers; True: all
    sync_module_states: bool = False  # rank 0's parameters and buffers broadcast (DDP's); else they must agree
    rank_wait_warning: float | None = 30.0  # seconds a CPU rank waits for the others at a call before it says so
    ring: int | None = None  # ranks of the ring under Ulysses x ring attention; None: planned from the model
    layout: str = "auto"  # the sequence over the ranks: head-tail where a causal ring gains; "contiguous" blocks

    @classmethod
    def parse(cls, options: dict | None) -> "Options":
        options = dict(options or {})
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise OptionsError(
                f"unknown ulysses option(s) {unknown}; valid options are {valid} "
                f"(see the README's Options table)"
            )
        parsed = cls(**options)
        parsed._check()
        if parsed.mesh is not None and "ring" in parsed.mesh.mesh_dim_names:
            return replace(parsed, ring=parsed.mesh["ring"].size())
        return parsed

    def _check(self) -> None:
        if self.compiler not in COMPILERS:
            raise OptionsError(f"option compiler={self.compiler!r}: expected one of {list(COMPILERS)}")
        if self.outputs not in OUTPUT_MODES:
            raise OptionsError(f"option outputs={self.outputs!r}: expected one of {list(OUTPUT_MODES)}")
        for name in ("check_inputs", "sync_module_states"):
            if not isinstance(getattr(self, name), bool):
                raise OptionsError(f"option {name}={getattr(self, name)!r}: expected True or False")
        if self.rank_wait_warning is not None and not (
                isinstance(self.rank_wait_warning, (int, float)) and not isinstance(self.rank_wait_warning, bool)
                and 0.001 <= self.rank_wait_warning < float("inf")):
            raise OptionsError(f"option rank_wait_warning={self.rank_wait_warning!r}: expected seconds (0.001 or "
                               f"more), or None")
        if self.ring is not None and (not isinstance(self.ring, int) or isinstance(self.ring, bool) or self.ring < 1):
            raise OptionsError(f"option ring={self.ring!r}: expected the ring's number of ranks (1: Ulysses only), "
                               f"or None to plan it from the model")
        if self.layout not in ("auto", "contiguous"):
            raise OptionsError(f"option layout={self.layout!r}: expected 'auto' (head-tail where a causal ring gains "
                               f"by it) or 'contiguous'")
        if self.tile_mlp not in (False, True, "checkpointed") or not isinstance(self.tile_mlp, (bool, str)):
            raise OptionsError(f"option tile_mlp={self.tile_mlp!r}: expected 'checkpointed', True or False")
        if self.verify not in (False, True, "short") or not isinstance(self.verify, (bool, str)):
            raise OptionsError(f"option verify={self.verify!r}: expected True, False or 'short'")
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise OptionsError(f"option dump_dir={self.dump_dir!r}: expected a folder path")
        if self.group is dist.GroupMember.NON_GROUP_MEMBER:
            raise OptionsError(
                f"option group: this rank (rank {dist.get_rank()} of the default group) is not a member of the "
                f"group it was given (dist.new_group returns a placeholder to ranks outside the group); give "
                f"each rank the group that contains it, e.g. create every group on every rank and pass "
                f"each rank its own"
            )
        if self.group is not None and not isinstance(self.group, dist.ProcessGroup):
            raise OptionsError(
                f"option group={self.group!r}: expected a torch.distributed.ProcessGroup "
                f"(for example dist.new_group(ranks)); pass a DeviceMesh as mesh= instead"
            )
        if self.mesh is not None:
            if self.group is not None:
                raise OptionsError("options group and mesh were both given: pass one of them")
            names = tuple(self.mesh.mesh_dim_names or ())
            if "sp" not in names:
                raise OptionsError(
                    f"option mesh has dims {names}; expected a dim named 'sp' for sequence "
                    f"parallelism, e.g. init_device_mesh('cpu', (P,), mesh_dim_names=('sp',))"
                )
            if "tp" in names:
                raise OptionsError(
                    f"option mesh has dims {names}: a 'tp' dim is not supported yet. Tensor parallelism splits "
                    f"each attention's heads over its ranks first, and Ulysses would split those heads again over "
                    f"the sequence ranks; pass the sub-mesh without it, e.g. mesh['dp', 'sp'], and leave the "
                    f"model unsharded by tensor parallelism"
                )
            if names not in (("sp",), ("dp", "sp"), ("ring", "sp"), ("dp", "ring", "sp")):
                raise OptionsError(
                    f"option mesh has dims {names}; expected ('sp',), ('dp', 'sp'), ('ring', 'sp') or ('dp', 'ring', "
                    f"'sp'), e.g. init_device_mesh('cpu', (D, P), mesh_dim_names=('dp', 'sp')); a 'ring' dim runs "
                    f"Ulysses over each 'sp' group and ring attention across them"
                )
            if "ring" in names and self.ring is not None and self.ring != self.mesh["ring"].size():
                raise OptionsError(
                    f"option ring={self.ring} and a mesh whose 'ring' dim has {self.mesh['ring'].size()} ranks: the "
                    f"mesh sets the ring; leave the option unset"
                )

    def data_parallel_group(self):
        """The group over which gradients are averaged (the mesh's "dp" dim), or None."""
        if self.mesh is not None and "dp" in (self.mesh.mesh_dim_names or ()):
            return self.mesh.get_group("dp")
        return None

    def sequence_mesh(self):
        """The sequence-parallel ranks as a one-dim mesh: the mesh's "sp" dim, or its "ring" and "sp" dims
        flattened (each "sp" group consecutive: Ulysses within it, the ring across them)."""
        if "ring" in self.mesh.mesh_dim_names:
            return flattened_mesh(self.mesh, ("ring", "sp"))
        return self.mesh["sp"]

    def group_name(self) -> str:
        """The name the graphs pass the sequence-parallel group by: one name on every rank of a mesh."""
        if self.mesh is None:
            return self.process_group().group_name
        if "ring" in self.mesh.mesh_dim_names:
            sequence = self.sequence_mesh()
            return mesh_group_name(sequence, sequence.mesh_dim_names[0], root=self.mesh)
        return mesh_group_name(self.mesh, "sp")

    def data_parallel_group_name(self) -> str:
        return mesh_group_name(self.mesh, "dp")

    def process_group(self):
        """The sequence-parallel group, or None when torch.distributed is not initialized."""
        if self.mesh is not None:
            return self.sequence_mesh().get_group()
        if self.group is not None:
            return self.group
        if dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        return None
