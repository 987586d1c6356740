"""The one place that imports private torch APIs, so a torch upgrade breaks in one file."""

from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.exc import BackendCompilerFailed
from torch._dynamo.utils import counters as dynamo_counters
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._guards import CompileContext, detect_fake_mode
from torch._inductor.compile_fx import compile_fx
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch._logging import trace_structured
from torch.distributed._functional_collectives import (
    all_gather_tensor,
    all_reduce,
    all_to_all_single,
)
from torch.distributed.checkpoint.state_dict import _init_optim_state
from torch.distributed.distributed_c10d import _get_group_size_by_name, _resolve_process_group
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.proxy import GraphAppendingTracer
from torch.utils._sympy.interp import sympy_interp
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._sympy.reference import PythonReferenceAnalysis

__all__ = [
    "BackendCompilerFailed",
    "CompileContext",
    "FakeStore",
    "FakeTensor",
    "FakeTensorMode",
    "c10d_functional",
    "FakeTensorProp",
    "GraphAppendingTracer",
    "PythonReferenceAnalysis",
    "_get_group_size_by_name",
    "_init_optim_state",
    "_resolve_process_group",
    "all_gather_tensor",
    "all_reduce",
    "all_to_all_single",
    "aot_autograd",
    "compile_fx",
    "detect_fake_mode",
    "dynamo_counters",
    "make_boxed_func",
    "min_cut_rematerialization_partition",
    "run_and_get_code",
    "statically_known_true",
    "sympy_interp",
    "trace_structured",
]

import torch  # noqa: E402

c10d_functional = torch.ops._c10d_functional


def register_torch_log(name: str) -> None:
    """Make ``TORCH_LOGS="+ulysses_compile"`` control the ``ulysses_compile`` logger."""
    from torch._logging._internal import log_registry, register_log

    if name not in log_registry.log_alias_to_log_qnames:
        register_log(name, name)


def process_group_timeout(group) -> str:
    """How long the group's collectives wait for the other ranks (its CPU backend's option)."""
    try:
        return str(group._get_backend(torch.device("cpu")).options._timeout)
    except (RuntimeError, AttributeError):
        return "see init_process_group(timeout=...)"
