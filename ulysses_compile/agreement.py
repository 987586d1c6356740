"""Ranks that disagree or fail get an error, not a hang or a wrong answer. Every call of a compiled
graph goes through :func:`guarded`:

- on every call, :class:`InputCheck` first compares where each rank is (the graph, its call number, the
  grad mode) and what it compiled (the captured graph and its input shapes and dtypes) in one
  all-gather of a fixed size, before any collective of the graph runs (on a GPU, from the second call
  on, one call later: the check does not hold up the step). A rank fed another batch shape,
  running other code, calling the model once more or under ``no_grad`` alone would otherwise enter
  collectives of other sizes or in another order than its peers and wait for them forever (gloo: abort
  the process); without the input check (``check_inputs=False``) the first call compares the programs;
- at the first call of each graph, and in ``parallelize`` before the parameters are partitioned,
  :func:`agree_on_module_state` compares the parameters and buffers the ranks hold (a fingerprint per
  tensor, one all-gather), or broadcasts rank 0's (``sync_module_states``, DDP's behaviour). A model
  built after a per-rank seed, or a buffer changed on one rank, would otherwise train a mix;
- in the same all-gather, :class:`InputCheck` compares the values of the user's inputs (a fingerprint
  per input), so ranks handed different batches of one shape get an error instead of training on a mix;
- a call after the graph's process group was destroyed is refused;
- a collective that fails in the forward (another rank died, or the group's timeout ran out because a
  rank raised or is stuck) becomes a :class:`CollectiveError` that says which rank and graph, the bound,
  and what to do. The backward's collectives run inside the autograd engine, where the process group's
  own error (e.g. gloo's "Timed out waiting 3000ms for recv operation") reaches ``loss.backward()``.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import logging
import re

import torch
import torch.distributed as dist
import torch.fx as fx

from ulysses_compile.core.boundary import GatheredOnUse
from ulysses_compile.core.collectives import gather_objects
from ulysses_compile.core.compat import _resolve_process_group, is_fake, process_group_timeout
from ulysses_compile.core.errors import CollectiveError, RankMismatchError, is_collective_failure

log = logging.getLogger("ulysses_compile")


def fingerprint(gm: fx.GraphModule, example_inputs) -> dict:
    """What every rank must agree on, computed before the rank-specific rewrite."""
    inputs = [
        f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}" if isinstance(x, torch.Tensor) else repr(x)
        for x in example_inputs
    ]
    return {"graph": hashlib.sha1(gm.code.encode()).hexdigest()[:12], "inputs": dict(zip(input_names(gm), inputs))}


def program_digest(expected: dict) -> int:
    """A ``fingerprint`` as a number, alike on every rank that compiled the same program (52 bits: exact in
    float64)."""
    return int(hashlib.sha1(repr(sorted(expected.items())).encode()).hexdigest(), 16) & _MASK_52


def input_names(gm: fx.GraphModule) -> list[str]:
    """The graph's inputs as the user's code names them: ``input_ids``, ``model.embed_tokens.weight``
    (Dynamo's placeholder ``L_args_0_modules_model_modules_embed_tokens_parameters_weight_``)."""
    names = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            name = re.sub(r"^L_(kwargs_|args_0_modules_|self_modules_)?|_$", "", node.target)
            names.append(re.sub(r"_(modules|parameters|buffers)_", ".", name))
    return names


def agree_on_module_state(tensors: dict[str, torch.Tensor], group, rank: int, sync: bool, where: str) -> None:
    """The parameters and buffers ``tensors`` (name -> tensor, the same names on every rank of ``group``)
    hold the same values on every rank: compared by fingerprint (``RankMismatchError`` naming the first
    that differ), or, with ``sync``, made so by broadcasting rank 0's in place."""
    real = {name: tensor for name, tensor in tensors.items() if not is_fake(tensor) and tensor.device.type != "meta"}
    if not real:
        return
    if sync:
        with torch.no_grad():
            for tensor in real.values():
                dist.broadcast(tensor, dist.get_global_rank(group, 0), group=group)
        if rank == 0:
            log.info("ulysses_compile: %s: rank 0's %d parameters and buffers broadcast to the %d ranks "
                     "(sync_module_states)", where, len(real), group.size())
        return
    digests = {name: _digest(tensor) for name, tensor in real.items()}
    seen = gather_objects(digests, group)
    differing = [name for name in digests if any(other.get(name) != digests[name] for other in seen)]
    if differing:
        ranks = [other for other, values in enumerate(seen) if values != seen[0]]
        shown = ", ".join(differing[:5]) + (f" and {len(differing) - 5} more" if len(differing) > 5 else "")
        raise RankMismatchError(
            f"rank {rank}: {where}: the ranks hold different parameters or buffers ({shown}; ranks {ranks} differ "
            f"from rank 0), so each would compute with its own model and the gradients would mix them. Build "
            f"the model alike on every rank (the same torch.manual_seed before constructing it, the same "
            f"checkpoint loaded), or pass options={{'sync_module_states': True}} (parallelize(..., "
            f"sync_module_states=True)) to broadcast rank 0's values, as DDP does (also where a checkpoint "
            f"loaded after parallelize sets them)."
        )


_INTEGER_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _digest(tensor: torch.Tensor) -> int:
    """A hash of a tensor's bits: the elements read as integers of their size (wider ones as several
    int64), times odd pseudo-random weights of their positions in that size, summed by block. Integer
    arithmetic wraps alike in any order, so equal tensors give equal digests on any hardware, where a
    floating sum could round otherwise; multiplying by an odd number is one-to-one modulo 2^bits, so a
    change of any one element changes its block's sum."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.int8)
    flat = flat.view(_INTEGER_OF_SIZE[min(flat.element_size(), 8)]).reshape(-1)
    table = _weights(flat.device)[:, 0].to(flat.dtype)  # (the low bits: still odd)
    wide = torch.int64 if flat.dtype == torch.int64 else torch.int32  # (a block's sum wraps in it)
    digest = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        chunk = flat[start:start + _CHUNK]
        whole = chunk.numel() // _BLOCK
        inner = torch.cat([(chunk[:whole * _BLOCK].view(whole, _BLOCK) * table).sum(-1, dtype=wide),
                           (chunk[whole * _BLOCK:] * table[:chunk.numel() - whole * _BLOCK]).sum(dtype=wide).view(1)])
        digest = digest + (inner.long() * _block_weights(start // _BLOCK, whole + 1, flat.device)[:, 0]).sum()
    return digest.item() ^ flat.numel()


def guarded(compiled, expected: dict, group, rank: int, graph_name: str, input_check: "InputCheck | None",
            module_state: list[tuple[int, str]] = (), sync_module_states: bool = False):
    """``compiled`` with the checks above; ``module_state``: the positions and names of the parameters and
    buffers among its inputs (not ZeRO shards)."""
    checked = False
    group_name, world_size, timeout = group.group_name, group.size(), process_group_timeout(group)

    def run(*args):
        nonlocal checked
        try:
            _resolve_process_group(group_name)
        except (RuntimeError, ValueError) as gone:
            raise CollectiveError(
                f"rank {rank}: {graph_name} was compiled for a process group of {world_size} ranks that has been "
                f"destroyed; call torch.compiler.reset() after init_process_group and compile the model again"
            ) from gone
        try:
            if input_check is not None:  # first: the place every rank is at, in a collective of one size
                input_check(args)
            elif not checked:
                _compare(gather_objects(expected, group), rank)
            if not checked:
                agree_on_module_state({name: args[position] for position, name in module_state}, group, rank,
                                      sync_module_states, graph_name)
                checked = True
            return compiled(*args)
        except RuntimeError as failure:
            if not is_collective_failure(failure):
                raise
            raise CollectiveError(
                f"rank {rank}: a collective of {graph_name} over {world_size} sequence-parallel ranks did not "
                f"complete ({failure}). Another rank failed, was stopped or is stuck: look for its error "
                f"first. The wait is bounded by the process group's timeout ({timeout}): "
                f"init_process_group(timeout=...) or new_group(timeout=...)."
            ) from failure

    return run


def _compare(seen: list[dict], rank: int) -> None:
    reference = seen[0]
    differing = [other for other, value in enumerate(seen) if value != reference]
    if not differing:
        return
    lines = []
    for name in reference["inputs"]:
        values = [value["inputs"].get(name) for value in seen]
        if len(set(values)) > 1:
            lines.append(f"  {name}: " + ", ".join(f"rank {r} {v}" for r, v in enumerate(values)))
    if not lines:
        lines.append("  the captured graphs differ: " + ", ".join(f"rank {r} {v['graph']}" for r, v in enumerate(seen)))
    raise RankMismatchError(
        f"rank {rank}: the sequence-parallel ranks compiled different programs (ranks {differing} differ from "
        f"rank 0), so their collectives would not match:\n" + "\n".join(lines) + "\nEvery rank of the group "
        "must pass the same global batch (same shapes and dtypes) and run the same code; a data-parallel "
        "replica with its own batch belongs on the mesh's \"dp\" dim."
    )


class InputCheck:
    """Every call, the ranks of the group must be at the same place (the same call of the same compiled
    graph, in the same grad mode) and pass the same values, not only the same shapes: a rank that calls
    the model once more than the others, or under ``torch.no_grad()`` alone, would meet their
    collectives with collectives of other sizes (a hang, or gloo aborting the process); a
    ``DistributedSampler``, HF Trainer or accelerate hand each rank its own batch, and each rank would
    then slice its block out of another sequence and train on the mix.

    Each call, every rank contributes ``_SLOTS`` float64 to one all-gather over the group: its place
    (a digest of the graph's code and input shapes, the grad mode, the graph's call number, the number
    of entries that follow), then a fingerprint of every user input (its number of elements, the sum of
    its values and two sums weighted by pseudo-random weights of the positions, so reordered values do
    not collide; for floating inputs also the sum of magnitudes). Ranks at different places get an
    error naming each rank's place (at a first call with only the programs differing: the inputs whose
    shapes or dtypes differ); entries beyond one all-gather's slots go in one more all-gather (a
    multiple of the slots) once the places agree. The first call waits for the result, so a mixed first
    batch never runs; so does every call on CPU ranks (gloo), where waiting holds up no device, and a
    wait past ``wait_warning`` seconds after a first call is logged with the place it waits at (a rank
    that left the loop, or is busy alone: the error comes at the process group's timeout). On a GPU,
    later calls leave it in flight and compare it at the next call (the result is copied to pinned
    memory behind an event, so the host never waits for the step): ranks at different places then meet
    in their programs first, and mixed inputs have run a step, which the error says; the last call of a
    run is compared only if another call follows, and entries past the first slots make the host wait
    for the previous step. Every rank of the group must have the check on or off alike. Integer inputs must agree
    exactly (sums wrap alike in int64); floating ones within 1e-6 of the sum of their magnitudes, since
    ranks may round differently (another kernel, another summation order)."""

    def __init__(self, names: list[str], positions: list[int], group, rank: int, graph_name: str, expected: dict,
                 draws: list[str] = (), wait_warning: float | None = None):
        self.names, self.positions = names, positions  # the user inputs among the graph's inputs
        self.group, self.rank, self.graph_name, self.draws = group, rank, graph_name, list(draws)
        self.expected, self.wait_warning = expected, wait_warning
        self.digest = program_digest(expected)
        self.device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
            else torch.device("cpu")
        if self.draws:
            self.names = [*names, GENERATOR]
        self.pending = None
        self.calls = 0

    def __call__(self, args) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._compare(*pending)
        entries, meaning = self._fingerprints(args)
        self.calls += 1
        grad = torch.is_grad_enabled()
        _GRAPHS[self.digest, grad] = self.graph_name  # (a graph Dynamo compiled again for no_grad has one digest)
        place = [float(self.digest), float(grad), float(self.calls), float(len(entries))]
        values = torch.cat([torch.tensor(place, dtype=torch.float64, device=self.device),
                            *(entry.to(self.device, torch.float64).reshape(1) for entry in entries)])
        padded = torch.zeros(-(-values.numel() // _SLOTS) * _SLOTS, dtype=torch.float64, device=self.device)
        padded[:values.numel()] = values
        gathered = torch.empty(self.group.size() * _SLOTS, dtype=torch.float64, device=self.device)
        work = dist.all_gather_single(gathered, padded[:_SLOTS], group=self.group, async_op=True)
        if gathered.is_cuda:
            work.wait()  # the stream waits for the all-gather, the host does not
            result = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            result.copy_(gathered, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            settle = copied.synchronize
        else:
            result, settle = gathered, functools.partial(self._wait, work)
        pending = (settle, result, padded[_SLOTS:], meaning, self.calls)
        if self.calls == 1 or not gathered.is_cuda:  # (waiting on a CPU all-gather holds up no device)
            self._compare(*pending, ran=False)
        else:
            self.pending = pending

    def _fingerprints(self, args) -> tuple[list[torch.Tensor], list[tuple]]:
        """The entries of the user inputs' fingerprints, and what each means: (input index, index of its
        magnitude entry or None, weight)."""
        entries, meaning = [], []
        values = [args[position] for position in self.positions]
        if self.draws:  # the state the graph's draws start from, on the device the graph runs on
            device = next((value.device for value in args if isinstance(value, torch.Tensor)), self.device)
            values.append(torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state())
        for index, value in enumerate(values):
            fingerprint, floating = _fingerprint(value)
            magnitude = len(entries) + 1 if floating else None
            meaning += [(index, None if slot == 0 else magnitude, _FLOAT_WEIGHT if slot >= 3 else 1)
                        for slot in range(len(fingerprint))]
            entries += fingerprint
        return entries, meaning

    def _wait(self, work) -> None:
        """Wait for a CPU all-gather; past ``wait_warning`` seconds (not at a first call, where a rank may
        still be compiling), say where this rank waits, and wait on."""
        if self.wait_warning is None or self.calls == 1:
            return work.wait()
        try:
            return work.wait(timeout=datetime.timedelta(seconds=self.wait_warning))
        except RuntimeError:
            if work.is_completed():
                raise  # the process group's own failure or timeout, not this wait's bound
        log.warning(
            "ulysses_compile: rank %d has waited %g s at call %d of %s (%s) for the other sequence-parallel "
            "ranks: one of them is not calling the model (it left the loop, made fewer calls, waits in another "
            "collective) or is busy alone (a checkpoint one rank writes, a slow data loader). The wait ends at "
            "the process group's timeout (%s).", self.rank, self.wait_warning, self.calls, self.graph_name,
            "grad" if torch.is_grad_enabled() else "no_grad", process_group_timeout(self.group))
        return work.wait()

    def _compare(self, settle, result, rest, meaning, call: int, ran: bool = True) -> None:
        settle()
        rows = result.view(self.group.size(), _SLOTS).tolist()
        places = [tuple(int(value) for value in row[:_PLACE]) for row in rows]
        if len(set(places)) > 1:
            self._refuse_places(places)
        if rest.numel():  # the entries past the first all-gather's slots, now that every rank has as many
            gathered = torch.empty(self.group.size() * rest.numel(), dtype=torch.float64, device=self.device)
            dist.all_gather_single(gathered, rest, group=self.group)
            rows = [row + more for row, more in zip(rows, gathered.view(self.group.size(), -1).tolist())]
        columns = list(zip(*(row[_PLACE:_PLACE + len(meaning)] for row in rows)))
        differing = []
        for (owner, magnitude, weight), column in zip(meaning, columns):
            tolerance = 0.0 if magnitude is None else 1e-6 * weight * max(columns[magnitude])
            if max(column) - min(column) > tolerance:
                differing.append(self.names[owner])
        if differing:
            when = "its first call" if call == 1 else f"call {call}, " + (
                "which has run (on a GPU the check settles at the next call)" if ran else "before it ran")
            if GENERATOR in differing:
                raise RankMismatchError(
                    f"rank {self.rank}: the sequence-parallel ranks' random generators are in different states at "
                    f"{self.graph_name} ({when}), which reads random draws whole on every rank "
                    f"({', '.join(self.draws[:3])}{' ...' if len(self.draws) > 3 else ''}: computed whole, not on "
                    f"the rank's block), so each rank would draw other values for the same tensor and the ranks "
                    f"would train different models. Seed every rank of the group alike (torch.manual_seed(seed), not "
                    f"seed + rank; a data-parallel replica may have its own, on the mesh's \"dp\" dim), and draw "
                    f"random numbers outside the model alike on every rank, or set the dropout to 0. "
                    f"options={{\"check_inputs\": False}} turns this check off."
                )
            raise RankMismatchError(
                f"rank {self.rank}: the sequence-parallel ranks passed different values in "
                f"{', '.join(dict.fromkeys(differing))} to {self.graph_name} ({when}), so each rank's block would "
                f"come from another sequence. Every rank of the group must pass the same global batch: a "
                f"DistributedSampler, HF Trainer or accelerate give each rank its own; sample per data-parallel "
                f"replica instead (num_replicas = the \"dp\" size, rank = the \"dp\" rank), or put ranks with their "
                f"own batches on the mesh's \"dp\" dim. options={{\"check_inputs\": False}} turns this check off."
            )

    def _refuse_places(self, places: list[tuple[int, ...]]) -> None:
        if all(call == 1 and grad == places[0][1] for _, grad, call, _ in places):
            _compare(gather_objects(self.expected, self.group), self.rank)  # every rank at its first call: the programs
        counts = len({count for *_, count in places}) > 1  # (a generator's state checked on some ranks only)
        where = "; ".join(
            f"rank {rank} at call {call} of {_GRAPHS.get((digest, bool(grad)), 'a graph this rank has not called')} "
            f"({'grad' if grad else 'no_grad'}{f', {count} entries' if counts else ''})"
            for rank, (digest, grad, call, count) in enumerate(places))
        raise RankMismatchError(
            f"rank {self.rank}: the sequence-parallel ranks are not at the same call of the same compiled graph: "
            f"{where}. Their programs' collectives would meet collectives of other sizes (a hang, or gloo "
            f"aborting the process). Every rank of the group must make the same calls of the model in the same "
            f"order, in the same grad mode (torch.no_grad(), evaluation) and with the same input shapes and dtypes: "
            f"a rank that calls the model once more (an extra evaluation batch, a last partial batch some ranks "
            f"do not have) stops them all."
        )


GENERATOR = "the random generator's state"  # what the input check compares beside the inputs, for draws read whole
_SLOTS = 64  # float64 values each rank adds to an all-gather of the input check (a fixed size: see InputCheck)
_PLACE = 4  # of which the call's place: the graph's digest, grad mode, call number, number of entries
_GRAPHS: dict[tuple[int, bool], str] = {}  # (digest, grad mode) of each graph called in this process -> its name
_BLOCK = 1 << 16  # elements weighted by one row of the weight table
_CHUNK = 1 << 22  # elements read at a time (a multiple of _BLOCK), so a large input costs no full-size copy
_FLOAT_WEIGHT = 4.0  # the largest weight of a floating input's weighted sums (two factors in [1, 2))
_MASK_52 = (1 << 52) - 1  # a hash folded to 52 bits is exact in float64, the all-gather's dtype


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 (products wrap as uint64 would; shifts made logical)."""
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * -7723592293110705685  # 0x94D049BB133111EB
    return z ^ ((z >> 31) & ((1 << 33) - 1))


@functools.cache
def _weights(device: torch.device) -> torch.Tensor:
    """Two odd pseudo-random int64 weights per position of a block, ``[BLOCK, 2]``, the same on every rank."""
    return (_mix(torch.arange(2 * _BLOCK, dtype=torch.int64, device=device)) | 1).view(2, _BLOCK).t()


def _block_weights(first: int, count: int, device: torch.device) -> torch.Tensor:
    """Two odd pseudo-random int64 weights per block, ``[count, 2]``, unlike any of ``_weights``."""
    return (_mix(torch.arange(2 * first, 2 * (first + count), dtype=torch.int64, device=device) + (1 << 40))
            | 1).view(count, 2)


def _unit(hashes: torch.Tensor) -> torch.Tensor:
    """Hashes as float64 weights in [1, 2)."""
    return 1.0 + (hashes & _MASK_52).double() / (1 << 52)


def _weighted_sums(chunk: torch.Tensor, first_block: int) -> torch.Tensor:
    """Two independent sums, ``[2]``, of a chunk's elements (float64 or int64, starting at block
    ``first_block``) times pseudo-random weights of their positions: position i's, a weight of
    i mod BLOCK times one of i // BLOCK, so a swap, a reversal or a permutation of rows changes them,
    unlike a sum with weights that repeat or grow linearly. int64: exact, products and sums wrapping
    alike on every rank; float64: weights in [1, 4), compared within a tolerance."""
    floating = chunk.is_floating_point()
    table, whole = _weights(chunk.device), chunk.numel() // _BLOCK
    blocks = chunk[:whole * _BLOCK].view(whole, _BLOCK)
    tail = chunk[whole * _BLOCK:]
    outer = _block_weights(first_block, whole + 1, chunk.device)
    if floating:
        table, outer = _unit(table), _unit(outer)
        return ((blocks @ table) * outer[:whole]).sum(0) + (tail @ table[:tail.numel()]) * outer[whole]
    inner = torch.cat([(blocks.unsqueeze(-1) * table).sum(1), (tail.unsqueeze(-1) * table[:tail.numel()]).sum(0, keepdim=True)])
    return (inner * outer).sum(0)


def _fingerprint(value) -> tuple[list[torch.Tensor], bool]:
    """0-d tensors that are equal for equal inputs: number of elements, (floating: sum of magnitudes,)
    sum and two position-weighted sums (``_weighted_sums``); and whether the input is floating."""
    if isinstance(value, (bool, int, float)):
        return [torch.tensor(float(value), dtype=torch.float64)], False
    if not isinstance(value, torch.Tensor) or isinstance(value, GatheredOnUse):
        return [], False  # (an output of a compiled graph, the same on every rank: reading it would gather it)
    flat = value.detach().reshape(-1)
    floating = flat.is_floating_point()
    dtype = torch.float64 if floating else torch.int64
    total = magnitude = torch.zeros((), dtype=dtype, device=flat.device)
    weighted = torch.zeros(2, dtype=dtype, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        chunk = flat[start:start + _CHUNK].to(dtype)
        total, weighted = total + chunk.sum(), weighted + _weighted_sums(chunk, start // _BLOCK)
        if floating:
            magnitude = magnitude + chunk.abs().sum()
    count = torch.tensor(float(flat.numel()), dtype=torch.float64)
    weighted = list(weighted if floating else weighted & _MASK_52)
    return ([count, magnitude, total, *weighted] if floating else [count, total, *weighted]), floating
