"""What torch loads for ``torch.compile(model, backend="ulysses")``: the ``torch_dynamo_backends`` entry
point. Loading it makes torch.compile enter the backend's context around each call of a compiled model
(``compat.honour_backend_contexts``), which torch.compile otherwise drops; the package itself does not
import this module, so ``import ulysses_compile`` changes nothing in torch."""

from ulysses_compile.backend import ulysses
from ulysses_compile.core.compat import honour_backend_contexts

honour_backend_contexts()

__all__ = ["ulysses"]
