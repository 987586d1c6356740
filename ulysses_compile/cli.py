"""``python -m ulysses_compile explain|verify FILE.py:FACTORY --world-size P``.

``FACTORY()`` returns ``(model, args, kwargs)``: the model and the inputs of one call, ``model(*args,
**kwargs)``. It is called after ``torch.manual_seed(0)``, so random weights and inputs are the same on
every rank.

explain  traces and rewrites the model for P ranks in this process (simulated ranks, no launcher) and
         prints the report: attention sites and their verdicts, collectives per step against the
         Ulysses minimum, fallbacks, graph breaks, the memory per rank of a training step;
         --seq-len N calls FACTORY(seq_len=N), --zero-stage K plans parallelize(zero_stage=K)
         (--param-dtype, --reduce-dtype: its mixed precision),
         --max-memory 80GiB adds the longest sequence whose step fits.
verify   launches P CPU (gloo) ranks; each runs one forward and backward compiled with
         ``parallelize(model, zero_stage=0)`` (backend="ulysses") and eagerly, and compares every
         output and parameter gradient. Prints a table of max abs / relative errors; exits 1 on a
         mismatch, 2 if a rank failed.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import inspect
import os
import re
import sys
import time
from pathlib import Path

import torch

from ulysses_compile.core.errors import UlyssesError
from ulysses_compile.verify import RTOL, compare, differentiable_scalar, named_tensors
from ulysses_compile.zero import parallelize

FACTORY_HELP = "FILE.py:FACTORY, where FACTORY() returns (model, args, kwargs)"


@functools.cache
def load_factory(spec: str):
    """``FILE.py:FACTORY`` -> the function (the file runs once)."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise UlyssesError(f"{spec!r}: expected {FACTORY_HELP}, e.g. model.py:make")
    file = Path(path)
    if not file.is_file():
        raise UlyssesError(f"{spec!r}: there is no file {file}")
    sys.path.insert(0, str(file.resolve().parent))  # the file may import its neighbours
    module_spec = importlib.util.spec_from_file_location(f"ulysses_factory_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # a dataclass in the file looks its module up there
    module_spec.loader.exec_module(module)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise UlyssesError(f"{spec!r}: {file} defines no function {name!r}")
    return factory


def build(spec: str, **factory_kwargs):
    torch.manual_seed(0)
    factory = load_factory(spec)
    try:
        if factory_kwargs:
            inspect.signature(factory).bind(**factory_kwargs)
    except TypeError:
        raise UlyssesError(f"{spec}: the factory takes no {', '.join(factory_kwargs)} argument; "
                           f"give it one (def {factory.__name__}(seq_len=...)) to plan at other lengths") from None
    built = factory(**factory_kwargs)
    if not (isinstance(built, tuple) and len(built) == 3 and isinstance(built[0], torch.nn.Module)
            and isinstance(built[1], (tuple, list)) and isinstance(built[2], dict)):
        raise UlyssesError(f"{spec}: the factory returned {type(built).__name__}; expected a tuple "
                           f"(model, args, kwargs) with an nn.Module, a tuple and a dict")
    return built


def _explain(arguments) -> int:
    from ulysses_compile.explain import explain

    started = time.perf_counter()
    lengths = {} if arguments.seq_len is None else {"seq_len": arguments.seq_len}
    model, args, kwargs = build(arguments.factory, **lengths)
    if arguments.generate:
        from ulysses_compile.explain import explain_generation

        kwargs = {key: value for key, value in kwargs.items() if key not in ("labels", "use_cache")}
        print(f"explain: {type(model).__name__} from {arguments.factory}: its prompt and {arguments.generate} "
              f"decoding step(s) at {arguments.world_size} simulated ranks ...", flush=True)
        print(explain_generation(model, kwargs.pop("input_ids"), world_size=arguments.world_size,
                                 new_tokens=arguments.generate, rank=arguments.rank, **kwargs))
        print(f"explain: done in {time.perf_counter() - started:.1f} s")
        return 0
    print(f"explain: {type(model).__name__} from {arguments.factory} at {arguments.world_size} simulated "
          f"ranks (this process is rank {arguments.rank}), ZeRO stage {arguments.zero_stage} ...", flush=True)
    report = explain(model, *args, world_size=arguments.world_size, rank=arguments.rank,
                     zero_stage=arguments.zero_stage, optimizer_states=arguments.optimizer_states,
                     param_dtype=_DTYPES.get(arguments.param_dtype), reduce_dtype=_DTYPES.get(arguments.reduce_dtype),
                     dynamic=True if arguments.max_memory is not None else None, **kwargs)
    print(report)
    if arguments.max_memory is not None:
        default = inspect.signature(load_factory(arguments.factory)).parameters.get("seq_len")
        length = arguments.seq_len or (default.default if default and isinstance(default.default, int) else None)
        print(_longest(report.memory, arguments.max_memory, arguments.world_size, length))
    print(f"explain: done in {time.perf_counter() - started:.1f} s")
    return 0


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_bytes(text: str) -> int:
    """``80GiB``, ``512MiB``, ``1.5TiB``, ``1000000`` -> bytes."""
    units = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
             "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in units:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 80GiB, 512MiB or 40GB")
    return int(float(match.group(1)) * units[match.group(2).upper()])


def _longest(memory, limit: int, world_size: int, seq_len: int | None) -> str:
    """The longest sequence whose estimated step peak fits in ``limit`` bytes per rank: the size symbol
    of value ``seq_len`` (the factory's length: ``--seq-len`` or its ``seq_len`` default; else the
    largest) is the length."""
    if not memory.hints:
        raise UlyssesError("--max-memory: the trace has no symbolic size; torch specialized the sequence length "
                           "to its value (TORCH_LOGS=dynamic shows where), so the estimate holds at this length only")
    lengths = [(symbol, value) for symbol, value in memory.hints.items()
               if value == (seq_len or max(memory.hints.values()))]
    if len(lengths) != 1:
        raise UlyssesError(f"--max-memory: cannot tell the sequence length among the trace's symbolic sizes "
                           f"{memory.hints or 'none'}; give --seq-len a value no other size of the inputs has")
    ((symbol, traced),) = lengths
    length = memory.longest(symbol, limit, step=world_size, start=traced)
    if length is None:
        return (f"\nmax memory {limit / 2**30:.2f} GiB per rank: not even {world_size} tokens fit (parameters and "
                f"optimizer state alone: {(memory.parameters + memory.optimizer_states * memory.trainable) / 2**30:.2f} GiB)")
    return (f"\nmax memory {limit / 2**30:.2f} GiB per rank: the longest sequence that fits at P = {world_size} is "
            f"{length:,} tokens (a multiple of P), estimated:\n{memory.at({symbol: length})}")


def _verify_rank(rank: int, world_size: int, port: int, arguments, results) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        model, args, kwargs = build(arguments.factory)
        eager = copy.deepcopy(model)
        compiled = parallelize(model, zero_stage=0, compiler=arguments.compiler)
        started = time.perf_counter()
        output = compiled(*args, **kwargs)
        _backward(output)
        seconds = time.perf_counter() - started
        reference = eager(*args, **kwargs)
        _backward(reference)
        pairs = [(f"output {name}", got, want) for (name, got), (_, want)
                 in zip(named_tensors(output), named_tensors(reference))]
        eager_grads = {name: param.grad for name, param in eager.named_parameters()}
        for name, param in model.named_parameters():
            if param.grad is not None or eager_grads[name] is not None:
                pairs.append((f"grad {name}", param.grad, eager_grads[name]))
        rows, ok = compare(pairs, arguments.rtol)
        results.put((rank, ok, rows, seconds))
    finally:
        dist.destroy_process_group()


def _backward(output) -> None:
    scalar = differentiable_scalar(output)
    if scalar is not None:
        scalar.backward()


def _verify(arguments) -> int:
    import socket

    import torch.multiprocessing as mp

    load_factory(arguments.factory)  # a wrong FILE.py:FACTORY fails here, once, not on every rank
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"verify: {arguments.factory} on {arguments.world_size} gloo ranks, compiler {arguments.compiler}, "
          f"rtol {arguments.rtol} of each reference's magnitude; starting the ranks ...", flush=True)
    started = time.perf_counter()
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    ranks = mp.start_processes(_verify_rank, args=(arguments.world_size, port, arguments, results),
                               nprocs=arguments.world_size, join=False, start_method="spawn")
    verdicts = []
    try:
        while not ranks.join(timeout=0.5):
            while not results.empty():  # read as they come: a rank blocks on a full pipe
                verdicts.append(results.get())
    except Exception as failure:  # a rank raised: its traceback is the message
        print(f"verify: a rank failed after {time.perf_counter() - started:.1f} s:\n{failure}", file=sys.stderr)
        return 2
    while not results.empty():
        verdicts.append(results.get())
    verdicts.sort()
    for rank, ok, rows, seconds in verdicts:
        if rank == 0 or not ok:
            print(f"rank {rank} (compiled forward and backward in {seconds:.1f} s):")
            print("\n".join(f"  {row}" for row in rows))
    bad = [rank for rank, ok, _, _ in verdicts if not ok]
    print(f"verify: {'MISMATCH on ranks ' + str(bad) if bad else 'every output and gradient matches eager'} "
          f"({time.perf_counter() - started:.1f} s)")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ulysses_compile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    explain = commands.add_parser("explain", help="report what the backend does at P ranks, in this process")
    verify = commands.add_parser("verify", help="run P gloo ranks and compare with eager; exit 1 on a mismatch")
    for command in (explain, verify):
        command.add_argument("factory", help=FACTORY_HELP)
        command.add_argument("--world-size", "-P", type=int, required=True, help="the number of ranks P")
    explain.add_argument("--rank", type=int, default=0, help="the rank whose program is reported (default 0)")
    explain.add_argument("--generate", type=int, default=0, metavar="N",
                         help="report inference instead: the prompt with a KV cache, then N decoding steps")
    explain.add_argument("--seq-len", type=int, help="call FACTORY(seq_len=N): plan at this sequence length")
    explain.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3),
                         help="plan ulysses_compile.parallelize(model, zero_stage=K) (default 0)")
    for name, what in (("--param-dtype", "gathers the parameters in"), ("--reduce-dtype", "reduces the gradients in")):
        explain.add_argument(name, choices=_DTYPES, help=f"plan parallelize(..., {name[2:].replace('-', '_')}=D): "
                                                         f"ZeRO {what} D (default: the parameters' dtype)")
    explain.add_argument("--optimizer-states", type=int, default=2,
                         help="tensors the size of each parameter the optimizer keeps (AdamW: 2, the default)")
    explain.add_argument("--max-memory", type=parse_bytes,
                         help="also print the longest sequence whose step fits in this much memory per rank "
                              "(e.g. 80GiB); traces once with a symbolic length")
    verify.add_argument("--compiler", default="aot_eager", choices=("inductor", "aot_eager", "eager"),
                        help="the inner compiler (default aot_eager: no code generation, quick)")
    verify.add_argument("--rtol", type=float, default=RTOL,
                        help=f"allowed max abs error relative to the reference's magnitude (default {RTOL})")
    arguments = parser.parse_args(argv)
    try:
        return _explain(arguments) if arguments.command == "explain" else _verify(arguments)
    except UlyssesError as error:
        print(f"{parser.prog} {arguments.command}: {error}", file=sys.stderr)
        return 2
