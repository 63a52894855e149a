# Copyright 2026 The Kimi K3 for transformers authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""The ground floor of `kimik3.kernels`: what every mechanism file shares, importing nothing else of the package.

* `twin(name, needs=...)`: registers a function as the fast twin of op `name` (the name of its declaration in the
  remote code's op table); `TWINS` is the registry `kimik3.kernels.load` reads. `needs` are the modules the twin
  cannot run without (imported when it is loaded: a missing one is the reason `available_ops` reports).
* `custom_op(name)`: a `torch.library` custom op `torch.ops.kimik3.<name>` that mutates no input; `CUSTOM_OPS` lists
  them. torch.compile cannot look inside a Triton launch wrapped in Python (or inside fla), so each such forward is
  one custom op with a fake implementation (output shapes, dtypes and strides from the inputs alone): a compiled
  graph keeps it as one node, with no graph break, and a CUDA graph (static-cache decode, mode "reduce-overhead")
  captures its launches. Each op's default implementation is the pure-PyTorch reference and its "cuda" kernel the
  fast one, so the ops register, and can be checked (`torch.library.opcheck`), on a CPU machine. None of them
  mutates an input (recurrent and conv states come back as new tensors, which the cache copies in), and every output
  is contiguous, on both the real and the fake side.
* `triton`, `tl`: Triton where it imports; elsewhere stand-ins under which the `@triton.jit` / `@triton.autotune`
  definitions of the mechanism files still evaluate (to kernels that refuse to launch, naming the import error), so
  every file imports and registers its custom ops on any machine. `HAS_TRITON` says which.
* `needs_grad`, `as_rows`: the tensor helpers of several twins.
"""

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["CUSTOM_OPS", "HAS_TRITON", "TWINS", "Twin", "as_rows", "custom_op", "needs_grad", "tl", "triton",
           "twin"]

NAMESPACE = "kimik3"


# --------------------------------------------------------------------------------------------------------------
# The twin registry


@dataclass(frozen=True)
class Twin:
    """The fast implementation of one op and what it cannot run without."""

    fn: Callable
    needs: tuple = ()  # module names, imported when the twin is loaded (ImportError: the reference runs)
    check: Callable | None = None  # raises ImportError where a feature it needs is missing (e.g. torch grouped_mm)

    def load(self) -> Callable:
        import importlib

        for module in self.needs:
            importlib.import_module(module)
        if self.check is not None:
            self.check()
        return self.fn


TWINS: dict = {}


def twin(name: str, needs: tuple = (), check: Callable | None = None):
    """Decorator: register the function as the fast twin of op `name`, with the reference's signature and contract."""

    def register(fn):
        if name in TWINS:
            raise ValueError(f"a fast twin of {name!r} is already registered ({TWINS[name].fn.__module__})")
        TWINS[name] = Twin(fn, tuple(needs), check)
        return fn

    return register


# --------------------------------------------------------------------------------------------------------------
# The custom-op namespace


CUSTOM_OPS: dict = {}


def custom_op(name: str):
    """Decorator: the function (typed like a torch.library schema) becomes the custom op `torch.ops.kimik3.<name>`,
    mutating none of its inputs; its body is the implementation on every device without a registered kernel."""

    def register(fn):
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())(fn)
        CUSTOM_OPS[name] = op
        return op

    return register


# --------------------------------------------------------------------------------------------------------------
# Triton, or stand-ins that refuse to launch


class _Unlaunchable:
    """A kernel defined where Triton does not import: launching it raises the import error."""

    def __init__(self, fn, error):
        self.fn, self._error = fn, error

    def __getitem__(self, grid):
        raise ImportError(f"{self.fn.__name__} needs Triton: {self._error}")


class _NoTriton:
    """`triton` / `triton.language` where Triton does not import: the names a mechanism file evaluates while it is
    imported (decorators, configs, constexpr annotations) work, any other raises the import error."""

    def __init__(self, error):
        self._error = error

    def jit(self, fn=None, **kwargs):
        if fn is None:
            return lambda f: _Unlaunchable(f, self._error)
        return _Unlaunchable(fn, self._error)

    def autotune(self, *args, **kwargs):
        return lambda kernel: kernel

    def Config(self, *args, **kwargs):  # noqa: N802 - triton's name
        return None

    def constexpr(self, value=None):
        return value

    def __getattr__(self, name):
        raise ImportError(f"triton.{name}: Triton does not import here ({self._error})")


try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception as exc:  # not installed, or a broken install: the twins that need it report why at load
    _reason = f"{type(exc).__name__}: {exc}"
    triton, tl = _NoTriton(_reason), _NoTriton(_reason)
    HAS_TRITON = False


# --------------------------------------------------------------------------------------------------------------
# Tensor helpers


def needs_grad(*tensors) -> bool:
    """Whether autograd records through any of these tensors (None entries skipped)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def as_rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """View x [..., width] as [rows, width] with unit stride on the last dim (copy only if needed)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    x2 = x.reshape(-1, width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2
