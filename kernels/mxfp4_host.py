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
"""Packed MXFP4 routed experts computed on the CPU, over their bytes in host memory (`csrc/mxfp4_host_experts.c`;
docs/design.md, Routed experts computed where they live).

The C file is compiled at first use with the system's C compiler (`cc`, or `$CC`) and OpenMP, `-O3 -march=native`,
into `$KIMIK3_KERNEL_CACHE` (default `~/.cache/kimik3/kernels`), under a name that hashes the source, the compiler
and the flags; a build that fails leaves `library()` None and `unavailable_reason()` saying why, and the pure-PyTorch
reference runs. ctypes releases the GIL for the call, so a Python thread can run it while the GPU works.

`host_experts(x, offsets, gate_up, down, betas)` is the op: the rows of x grouped by expert, each expert's packed
stacks as (codes, scales) views of its host tensors (gate_up fused, or its gate and up matrices apart: the release's
w1 and w3 mapped from its shards); it returns each row's expert output in x's dtype (f32 or bf16),
the value `ops_kimi_k3.routed_experts` gives that row before the routing weights (tests/test_host_experts.py holds
it against that reference).
"""

import ctypes
import hashlib
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import weakref
from pathlib import Path

import torch

from kimik3.modeling.ops_kimi_k3 import MXFP4_GROUP_SIZE

from ._base import custom_op

SOURCE = Path(__file__).with_name("csrc") / "mxfp4_host_experts.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
_lock = threading.Lock()
_state: dict = {}


def _cache_dir() -> Path:
    return Path(os.environ.get("KIMIK3_KERNEL_CACHE") or Path.home() / ".cache" / "kimik3" / "kernels")


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build() -> ctypes.CDLL:
    compiler = _compiler()
    if compiler is None:
        raise OSError("no C compiler (cc, gcc or clang; or $CC) to build the host experts kernel")
    source = SOURCE.read_bytes()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise OSError(f"{compiler} --version failed: {error}") from error
    key = hashlib.sha256(source + version.encode() + " ".join(FLAGS).encode() + sys.platform.encode()).hexdigest()[:16]
    target = _cache_dir() / f"k3_mxfp4_host_{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # built beside the target, then renamed: a library half written by a build that died is never loaded
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            run = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], capture_output=True,
                                 text=True, timeout=300)
            if run.returncode:
                raise OSError(f"building the host experts kernel failed ({compiler}): {run.stderr.strip()[-2000:]}")
            os.replace(built, target)
    lib = ctypes.CDLL(str(target))
    fn = lib.k3_mxfp4_host_experts
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, *[ctypes.c_void_p] * 6,
                   ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_float, ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.k3_host_routes_step.restype = None
    lib.k3_host_routes_step.argtypes = [ctypes.c_void_p]
    lib.k3_mxfp4_host_isa.restype = ctypes.c_char_p
    lib.k3_mxfp4_host_bf16_dot.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The built kernel library, built on the first call; None where it cannot be built (`unavailable_reason`)."""
    with _lock:
        if "lib" not in _state:
            try:
                _state["lib"], _state["reason"] = _build(), None
            except (OSError, subprocess.SubprocessError) as error:
                _state["lib"], _state["reason"] = None, str(error)
        return _state["lib"]


def unavailable_reason() -> str | None:
    library()
    return _state["reason"]


def isa() -> str | None:
    """The instruction set the build uses ("avx512-bf16", "avx512", "avx2" or "scalar"), None without a build."""
    lib = library()
    return None if lib is None else lib.k3_mxfp4_host_isa().decode()


def _pointers(tensors) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))


def _check_stack(name: str, codes: torch.Tensor, scales: torch.Tensor, rows: int, k: int) -> None:
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"{name}: MXFP4 codes and scales are uint8, got {codes.dtype} and {scales.dtype}")
    if tuple(codes.shape) != (rows, k // 2) or tuple(scales.shape) != (rows, k // MXFP4_GROUP_SIZE):
        raise ValueError(f"{name}: codes {tuple(codes.shape)} and scales {tuple(scales.shape)} do not make a packed "
                         f"[{rows}, {k}] matrix (codes [{rows}, {k // 2}], scales [{rows}, {k // MXFP4_GROUP_SIZE}])")
    if codes.device.type != "cpu" or scales.device.type != "cpu" or not codes.is_contiguous() \
            or not scales.is_contiguous():
        raise ValueError(f"{name}: the host kernel reads contiguous CPU tensors")


def _gate_and_up(name: str, codes, scales, inter: int, k: int) -> tuple[torch.Tensor, ...]:
    """One expert's (gate codes, gate scales, up codes, up scales): from a fused gate_up (codes [2I, K/2], scales
    [2I, K/32]; gate rows first), or from its gate and up apart ((w1, w3) codes and (w1, w3) scales, [I, ...] each)."""
    if isinstance(codes, torch.Tensor):
        _check_stack(name, codes, scales, 2 * inter, k)
        return codes[:inter], scales[:inter], codes[inter:], scales[inter:]
    if len(codes) != 2 or len(scales) != 2:
        raise ValueError(f"{name}: gate and up apart are two codes and two scales tensors, got {len(codes)} and "
                         f"{len(scales)}")
    _check_stack(f"{name} (gate)", codes[0], scales[0], inter, k)
    _check_stack(f"{name} (up)", codes[1], scales[1], inter, k)
    return codes[0], scales[0], codes[1], scales[1]


def _down(name: str, codes, scales, inter: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's down (codes, scales): tensors, or one-tensor tuples (the release's w2)."""
    codes, scales = (part if isinstance(part, torch.Tensor) else part[0] for part in (codes, scales))
    _check_stack(name, codes, scales, k, inter)
    return codes, scales


def _gate_up_dims(gate_up_codes) -> tuple[int, int]:
    """(K, I) of an expert's gate_up codes, fused [2I, K/2] or apart ((w1, w3) [I, K/2] each)."""
    if isinstance(gate_up_codes, torch.Tensor):
        return 2 * gate_up_codes.shape[-1], gate_up_codes.shape[0] // 2
    return 2 * gate_up_codes[0].shape[-1], gate_up_codes[0].shape[0]


def _expert_pointers(gate_up, down, inter: int, k: int) -> list[ctypes.Array]:
    """The six pointer lists the kernel reads (gate codes, gate scales, up codes, up scales, down codes, down
    scales), one entry an expert, each tensor checked by name."""
    lists = [[] for _ in range(6)]
    for e, ((gu_codes, gu_scales), (dn_codes, dn_scales)) in enumerate(zip(gate_up, down)):
        tensors = (*_gate_and_up(f"gate_up of expert {e}", gu_codes, gu_scales, inter, k),
                   *_down(f"down of expert {e}", dn_codes, dn_scales, inter, k))
        for pointers, tensor in zip(lists, tensors):
            pointers.append(tensor)
    return [_pointers(tensors) for tensors in lists]


def thread_count(suggested: int | None = None) -> int:
    """The kernel's threads: `KIMIK3_HOST_THREADS` where set, else `suggested` (the caller's), else torch's intra-op
    thread count."""
    given = os.environ.get("KIMIK3_HOST_THREADS", "")
    if given:
        if not given.isdigit() or int(given) < 1:
            raise ValueError(f"KIMIK3_HOST_THREADS={given!r}: give a whole number of threads, at least 1")
        return int(given)
    return suggested or torch.get_num_threads()


def host_experts(x: torch.Tensor, offsets: list[int], gate_up: list[tuple[torch.Tensor, torch.Tensor]],
                 down: list[tuple[torch.Tensor, torch.Tensor]], beta: float | None, linear_beta: float | None,
                 threads: int | None = None) -> torch.Tensor:
    """x [R, K] (f32 or bf16, CPU): rows offsets[e] .. offsets[e+1] routed to expert e, whose packed stacks are
    gate_up[e] = (codes [2I, K/2], scales [2I, K/32]) (or its gate and up apart: ((w1, w3) codes, (w1, w3) scales))
    and down[e] = (codes [K, I/2], scales [K, I/32]). Returns [R, K] in x's dtype: each row's expert output before the
    routing weight."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the host experts kernel is not available: {unavailable_reason()}")
    if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2 or x.device.type != "cpu":
        raise ValueError(f"host experts: x must be a [rows, K] f32 or bf16 CPU tensor, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    rows, k = x.shape
    n = len(gate_up)
    if len(down) != n or len(offsets) != n + 1 or offsets[0] != 0 or offsets[-1] != rows \
            or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"host experts: offsets {offsets} do not split {rows} rows among {n} experts")
    if n == 0 or rows == 0:
        return x.new_zeros(rows, k)
    inter = _gate_up_dims(gate_up[0][0])[1]
    if k % MXFP4_GROUP_SIZE or inter % MXFP4_GROUP_SIZE:
        raise ValueError(f"host experts: K={k} and I={inter} must be multiples of {MXFP4_GROUP_SIZE}")
    pointers = _expert_pointers(gate_up, down, inter, k)
    # a bf16 model's rows stay bf16 where the build has AVX512-BF16 (its pair dot product); else f32 (exact)
    bf16_dot = x.dtype == torch.bfloat16 and bool(lib.k3_mxfp4_host_bf16_dot())
    work = torch.bfloat16 if bf16_dot else torch.float32
    split = x.to(work).reshape(rows, k // 2, 2)
    x_even, x_odd = split[..., 0].contiguous(), split[..., 1].contiguous()
    hidden_even = torch.empty(rows, inter // 2, dtype=work)
    hidden_odd = torch.empty(rows, inter // 2, dtype=work)
    out = torch.empty(rows, k)
    offsets_c = (ctypes.c_int64 * (n + 1))(*offsets)
    status = lib.k3_mxfp4_host_experts(
        x_even.data_ptr(), x_odd.data_ptr(), offsets_c, n, *pointers, k, inter,
        1.0 if beta is None else float(beta), 0.0 if linear_beta is None else float(linear_beta),
        int(linear_beta is not None), int(x.dtype == torch.bfloat16), int(bf16_dot),
        hidden_even.data_ptr(), hidden_odd.data_ptr(), out.data_ptr(), thread_count(threads))
    if status:
        raise MemoryError(f"host experts: the kernel failed (status {status}: -1 its work lists could not be "
                          "allocated)")
    return out.to(x.dtype)


# --------------------------------------------------------------------------------------------------------------
# One MoE layer's routes computed on the CPU in a CUDA stream's order (`k3_host_routes_step` in the C file): the
# layer's rows and routes are copied into pinned host memory, a host function (cuLaunchHostFunc) runs the step when
# the stream reaches it, and its outputs are copied back, all queued on the stream, so the thread that drives the GPU
# never reads the routes and a decode step captures whole in one CUDA graph (the three are capturable: two copies
# and a host node). The step's buffers have fixed addresses, as a captured graph needs.


class _RouteStepArgs(ctypes.Structure):
    # the C struct k3_route_step, field for field
    _fields_ = [(name, ctypes.c_int64) for name in ("tokens", "top_k", "K", "I", "num_experts")] + \
        [(name, ctypes.c_void_p) for name in ("x", "ids", "out", "gate_codes", "gate_scales", "up_codes", "up_scales",
                                              "down_codes", "down_scales", "held", "routes")] + \
        [("beta", ctypes.c_float), ("linear_beta", ctypes.c_float)] + \
        [(name, ctypes.c_int) for name in ("has_linear_beta", "bf16", "bf16_dot", "threads")] + \
        [(name, ctypes.c_void_p) for name in ("order", "count", "offsets", "chosen", "x_even", "x_odd",
                                              "hidden_even", "hidden_odd", "work")] + \
        [("status", ctypes.c_int)]


STEP_STATUS = {-1: "its work lists could not be allocated", -3: "a route's expert id is out of range"}


class ExpertTable:
    """One layer's experts as the step reads them: each expert's six pointers (gate, up and down codes and scales)
    and `routes` [E] (int64, the routes the steps counted per expert). `gate_up` and `down` are (codes, scales), each
    a host stack [E, ...] or a list of one entry an expert (the release's parts: (w1, w3) and (w2,), mapped from its
    shards). Holds them, so the pointers stay valid."""

    def __init__(self, gate_up, down, routes: torch.Tensor):
        num_experts = len(gate_up[0])
        k, inter = _gate_up_dims(gate_up[0][0])
        if routes.dtype != torch.int64 or routes.shape != (num_experts,) or routes.device.type != "cpu" \
                or not routes.is_contiguous():
            raise ValueError(f"the routes' counts must be a contiguous int64 CPU tensor of {num_experts} values, got "
                             f"{routes.dtype} {tuple(routes.shape)} on {routes.device}")
        self.stacks = (*gate_up, *down)
        self.num_experts, self.k, self.inter = num_experts, k, inter
        self.pointers = _expert_pointers(zip(gate_up[0], gate_up[1]), zip(down[0], down[1]), inter, k)
        self.routes = routes


class StepBuffers:
    """The pinned buffers (the rows, the routes, the outputs) and the workspace of the host steps of one shape on one
    device, shared by every layer's step of that shape: their host functions run one after another in the stream's
    order, each done with them before the next layer's copies start (one stream a device)."""

    def __init__(self, tokens: int, top_k: int, k: int, inter: int, num_experts: int, dtype: torch.dtype,
                 bf16_dot: bool, pinned: bool):
        routes = tokens * top_k
        work = torch.bfloat16 if bf16_dot else torch.float32
        self.x = torch.empty(tokens, k, dtype=dtype, pin_memory=pinned)
        self.ids = torch.empty(tokens, top_k, dtype=torch.int64, pin_memory=pinned)
        self.out = torch.empty(routes, k, dtype=dtype, pin_memory=pinned)
        # count [E + 1]: the step reuses it for the n + 1 offsets of its experts, n up to E
        self.workspace = [torch.empty(routes, dtype=torch.int64), torch.empty(num_experts + 1, dtype=torch.int64),
                          torch.empty(num_experts + 1, dtype=torch.int64),
                          torch.empty(6 * num_experts, dtype=torch.int64),  # pointers
                          torch.empty(num_experts, dtype=torch.uint8),  # the held experts
                          torch.empty(routes, k // 2, dtype=work), torch.empty(routes, k // 2, dtype=work),
                          torch.empty(routes, inter // 2, dtype=work), torch.empty(routes, inter // 2, dtype=work),
                          torch.empty(routes, k, dtype=torch.float32)]


_BUFFERS: "weakref.WeakValueDictionary[tuple, StepBuffers]" = weakref.WeakValueDictionary()


def step_buffers(tokens: int, top_k: int, k: int, inter: int, num_experts: int, dtype: torch.dtype, bf16_dot: bool,
                 device: torch.device) -> StepBuffers:
    """The shared buffers of the steps of this shape on `device` (pinned on CUDA), made while none is alive."""
    key = (tokens, top_k, k, inter, num_experts, dtype, bf16_dot, str(device))
    with _lock:
        buffers = _BUFFERS.get(key)
        if buffers is None:
            buffers = _BUFFERS[key] = StepBuffers(tokens, top_k, k, inter, num_experts, dtype, bf16_dot,
                                                  pinned=device.type == "cuda")
        return buffers


class HostRouteStep:
    """The CPU's step for one layer's routes of `tokens` tokens x `top_k` (`table`: the layer's experts) in `dtype`
    (f32 or bf16): `run(x, ids)` returns [tokens x top_k, K] in dtype, each route's expert output before its routing
    weight, in the order ops_kimi_k3.routed_experts takes the routes (by expert, stable), zero for the routes the
    device holds (given as -1 - expert in `ids`). On CUDA it is queued on the current stream (nothing waits); on the
    CPU it runs at once."""

    def __init__(self, table: ExpertTable, tokens: int, top_k: int, dtype: torch.dtype, beta: float,
                 linear_beta: float | None, device: torch.device, threads: int | None = None):
        lib = library()
        if lib is None:
            raise RuntimeError(f"the host experts kernel is not available: {unavailable_reason()}")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"host route step: the model's dtype must be f32 or bf16, got {dtype}")
        k, inter, num_experts = table.k, table.inter, table.num_experts
        if k % MXFP4_GROUP_SIZE or inter % MXFP4_GROUP_SIZE:
            raise ValueError(f"host route step: K={k} and I={inter} must be multiples of {MXFP4_GROUP_SIZE}")
        bf16_dot = dtype == torch.bfloat16 and bool(lib.k3_mxfp4_host_bf16_dot())
        self.table, self.tokens, self.top_k, self.dtype = table, tokens, top_k, dtype
        self.buffers = step_buffers(tokens, top_k, k, inter, num_experts, dtype, bf16_dot, torch.device(device))
        self.x, self.ids, self.out = self.buffers.x, self.buffers.ids, self.buffers.out
        order, count, offsets, chosen, held, x_even, x_odd, hidden_even, hidden_odd, out_f32 = \
            (t.data_ptr() for t in self.buffers.workspace)
        self.args = _RouteStepArgs(
            tokens, top_k, k, inter, num_experts, self.x.data_ptr(), self.ids.data_ptr(), self.out.data_ptr(),
            *(ctypes.addressof(p) for p in table.pointers), held, table.routes.data_ptr(),
            float(beta), 0.0 if linear_beta is None else float(linear_beta), int(linear_beta is not None),
            int(dtype == torch.bfloat16), int(bf16_dot), thread_count(threads), order, count, offsets, chosen,
            x_even, x_odd, hidden_even, hidden_odd, out_f32, 0)
        self.function = ctypes.cast(lib.k3_host_routes_step, ctypes.c_void_p).value

    def check(self) -> None:
        """Raises if the last step that ran failed (it wrote zeros): a queued step cannot raise, the next call does."""
        status = self.args.status
        if status:
            self.args.status = 0
            raise RuntimeError(f"the host route step failed (status {status}: {STEP_STATUS.get(status, 'unknown')})")

    def run(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self.check()
        if tuple(x.shape) != tuple(self.x.shape) or x.dtype != self.dtype or tuple(ids.shape) != tuple(self.ids.shape):
            raise ValueError(f"host route step: built for x {tuple(self.x.shape)} {self.dtype} and routes "
                             f"{tuple(self.ids.shape)}, given {tuple(x.shape)} {x.dtype} and {tuple(ids.shape)}")
        if x.device.type != "cuda":
            self.args.threads = thread_count()
            self.x.copy_(x)
            self.ids.copy_(ids)
            library().k3_host_routes_step(ctypes.addressof(self.args))
            self.check()
            return self.out.clone()
        x, ids = x.contiguous(), ids.to(torch.int64).contiguous()
        self.args.threads = thread_count()  # read by the host function when it runs (a replayed graph: the last)
        out = torch.empty(self.out.shape, dtype=self.dtype, device=x.device)
        stream = ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream)
        driver = _driver()
        with torch.cuda.device(x.device):
            _cuda("cuMemcpyDtoHAsync_v2", driver.cuMemcpyDtoHAsync_v2(
                self.x.data_ptr(), x.data_ptr(), self.x.numel() * self.x.element_size(), stream))
            _cuda("cuMemcpyDtoHAsync_v2", driver.cuMemcpyDtoHAsync_v2(
                self.ids.data_ptr(), ids.data_ptr(), self.ids.numel() * 8, stream))
            _cuda("cuLaunchHostFunc", driver.cuLaunchHostFunc(stream, self.function, ctypes.addressof(self.args)))
            _cuda("cuMemcpyHtoDAsync_v2", driver.cuMemcpyHtoDAsync_v2(
                out.data_ptr(), self.out.data_ptr(), self.out.numel() * self.out.element_size(), stream))
        return out


def _driver() -> ctypes.CDLL:
    """The CUDA driver library (the copies and the host function are driver calls on torch's stream)."""
    with _lock:
        if "driver" not in _state:
            driver = ctypes.CDLL("libcuda.so.1")
            driver.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            driver.cuMemcpyDtoHAsync_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t,
                                                    ctypes.c_void_p]
            driver.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t,
                                                    ctypes.c_void_p]
            for fn in (driver.cuLaunchHostFunc, driver.cuMemcpyDtoHAsync_v2, driver.cuMemcpyHtoDAsync_v2):
                fn.restype = ctypes.c_int
            _state["driver"] = driver
        return _state["driver"]


def _cuda(name: str, result: int) -> None:
    if result:
        raise RuntimeError(f"{name} failed with CUresult {result}")


# The steps made, by number: the custom op takes the number (an int is a constant of a compiled graph). Weak: the
# caller keeps its steps alive (host_experts_kimi_k3.StreamedRoutes, as long as its model), so a model's pinned
# buffers go with it.
_STEPS: "weakref.WeakValueDictionary[int, HostRouteStep]" = weakref.WeakValueDictionary()
_NEXT_STEP = itertools.count()


def register_step(step: HostRouteStep) -> int:
    """The step's number for `host_routes_in_stream`; the caller keeps the step alive."""
    number = next(_NEXT_STEP)
    _STEPS[number] = step
    return number


@custom_op("host_routes")
def _host_routes_op(x: torch.Tensor, ids: torch.Tensor, step: int) -> torch.Tensor:
    made = _STEPS.get(step)
    if made is None:
        raise RuntimeError(f"host route step {step} is gone (its model was freed)")
    return made.run(x, ids)


@_host_routes_op.register_fake
def _(x, ids, step):
    return x.new_empty(ids.numel(), x.shape[-1])


def host_routes_in_stream(x: torch.Tensor, ids: torch.Tensor, step: int) -> torch.Tensor:
    """`HostRouteStep.run` of the registered step `step` as one graph node (`torch.ops.kimik3.host_routes`)."""
    return torch.ops.kimik3.host_routes(x, ids, step)


__all__ = ["ExpertTable", "HostRouteStep", "StepBuffers", "host_experts", "host_routes_in_stream", "isa", "library", "register_step",
           "unavailable_reason"]
