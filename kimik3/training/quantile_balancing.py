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
"""Quantile Balancing of the MoE router bias (docs/architecture.md, Quantile Balancing; router contract in
docs/design.md).

During training the gate routes on ``s + b`` (``s = sigmoid(router_logits)``, ``b = e_score_correction_bias``) with
top-(k+1): the first k experts are the routes, the (k+1)-th biased score is the token's cutoff ``alpha_i``. The
"required bias" of expert j for token i is ``r_ij = alpha_i - s_ij``: the token would pick j if ``b_j > r_ij``
(holding ``alpha`` fixed). The new bias of expert j is the bias at which exactly the target load
``q = N * k / E`` of the batch's N tokens qualify,

    b_hat_j = -quantile_{1 - k/E}(s_:j - alpha) = quantile_{k/E}(r_:j),      b = b_hat - mean(b_hat),

one exact coordinate step on the dual of the balanced-assignment LP (no step size, no auxiliary loss). It is applied
from the next step, so a batch is never routed with a bias derived from itself.

In practice the quantile comes from a histogram: ``r_ij`` always lies in ``(b_min - 1, b_max + 1)`` of the current
bias (because ``alpha_i = s_il + b_l`` for some expert l and ``s`` is in (0, 1)), so B uniform bins over that range,
counted per expert over every micro-batch of a step and summed over data-parallel ranks with one integer
all-reduce, give the quantile to within one bin width.

Pieces:

* :func:`exact_bias` - the exact order-statistic solution (reference, tests).
* :func:`histogram_counts` / :func:`histogram_bias` / :func:`estimate_bias_histogram` - the histogram estimator.
* :class:`QuantileBalancer` - attaches an observer to every ``KimiK3MoEGate`` (attribute
  ``quantile_balancing_observer``), switches ``config.quantile_balancing`` on, and updates the biases with
  :meth:`QuantileBalancer.step` between optimizer steps.
* :class:`QuantileBalancingCallback` - the ``transformers.Trainer`` switch: ``callbacks=[QuantileBalancingCallback()]``.
* :class:`ExpertLoadMonitor` - counts the routed top-k loads of every gate through forward hooks, with or without
  balancing (for measuring imbalance).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


GATE_CLASS_NAME = "KimiK3MoEGate"
BIAS_NAME = "e_score_correction_bias"
OBSERVER_ATTR = "quantile_balancing_observer"
DEFAULT_NUM_BINS = 512


# ----------------------------------------------------------------------------------------------------------------------
# Math
def required_bias(scores: torch.Tensor, cutoff: torch.Tensor) -> torch.Tensor:
    """``r_ij = alpha_i - s_ij`` in f32: the smallest bias with which expert j would reach token i's cutoff."""
    return cutoff.float()[:, None] - scores.float()


def target_load(num_tokens: int | float, top_k: int, num_experts: int) -> float:
    """Target tokens per expert ``q = N * k / E``."""
    return float(num_tokens) * top_k / num_experts


def _center(bias: torch.Tensor) -> torch.Tensor:
    return bias - bias.mean()


def exact_bias(scores: torch.Tensor, cutoff: torch.Tensor, k: int, center: bool = True) -> torch.Tensor:
    """Exact Quantile Balancing target bias.

    Args:
        scores: ``[N, E]`` unbiased router scores ``sigmoid(logits)`` of the tokens of one step.
        cutoff: ``[N]`` each token's (k+1)-th biased score ``alpha_i`` (taken with the bias the batch was routed with).
        k: experts per token.
        center: subtract the mean (the update rule); ``False`` returns ``b_hat`` itself.

    Returns:
        ``[E]`` f32. Per expert j, ``b_hat_j`` is the ``ceil(q)``-th smallest ``r_ij = alpha_i - s_ij`` with
        ``q = N k / E``, i.e. ``-quantile_{1-k/E}(s_:j - alpha)`` (inverse-CDF quantile): exactly ``ceil(q)`` tokens
        (barring ties) have ``s_ij + b_hat_j >= alpha_i``.
    """
    if scores.dim() != 2 or cutoff.shape != scores.shape[:1]:
        raise ValueError(f"scores must be [N, E] and cutoff [N], got {tuple(scores.shape)} and {tuple(cutoff.shape)}")
    n, e = scores.shape
    if n == 0:
        raise ValueError("exact_bias needs at least one token")
    if not 0 < k < e:
        raise ValueError(f"k must be in 1..E-1, got k={k}, E={e}")
    rank = max(1, math.ceil(target_load(n, k, e) - 1e-9))
    r = required_bias(scores, cutoff)
    b_hat = torch.kthvalue(r, rank, dim=0).values
    return _center(b_hat) if center else b_hat


def bin_range(bias: torch.Tensor, num_bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, width)`` of the B uniform bins over ``[min(bias) - 1, max(bias) + 1]`` of the current bias, as f32
    tensors on the bias' device (no host sync); for a stack of biases ``[L, E]`` they are ``[L]``."""
    b = bias.detach().float()
    lo = b.amin(-1) - 1.0
    hi = b.amax(-1) + 1.0
    return lo, (hi - lo) / num_bins


def histogram_counts(scores: torch.Tensor, cutoff: torch.Tensor, lo, width, num_bins: int) -> torch.Tensor:
    """Per-expert histogram ``[E, B]`` (int64) of ``r_ij = alpha_i - s_ij`` over the bins ``lo + [0, B) * width``.

    Values outside the range (cannot happen with the range of :func:`bin_range`, up to rounding) go to the end bins.
    """
    n, e = scores.shape
    if n == 0:
        return torch.zeros(e, num_bins, dtype=torch.long, device=scores.device)
    r = required_bias(scores, cutoff)
    idx = torch.floor((r - lo) / width).clamp_(0, num_bins - 1).long()
    idx += torch.arange(e, device=idx.device) * num_bins
    return torch.bincount(idx.reshape(-1), minlength=e * num_bins).view(e, num_bins)


def histogram_bias(counts: torch.Tensor, lo, width, q) -> torch.Tensor:
    """Quantile read from per-expert histograms ``counts [..., E, B]``: the first bin whose cumulative count
    reaches ``ceil(q)``, linearly interpolated inside it:

        b_hat_j = lo + (bin + clip((q - c_before) / h_bin, 0, 1)) * width

    ``lo``, ``width`` and ``q`` are numbers or tensors of the leading shape ``[...]``. Returns ``b_hat [..., E]``
    f32 (not centred).
    """
    counts = counts.long()
    cum = counts.cumsum(-1)
    as_lead = lambda x: torch.as_tensor(x, dtype=torch.float64, device=counts.device)[..., None]  # noqa: E731
    q, lo, width = as_lead(q), as_lead(lo), as_lead(width)
    need = torch.ceil(q - 1e-9).clamp(min=1)
    # first bin with cum >= need (cum is non-decreasing, so count the bins below it)
    first = (cum < need[..., None]).sum(-1).clamp_(max=counts.shape[-1] - 1)
    h = counts.gather(-1, first[..., None]).squeeze(-1).double()
    c_before = cum.gather(-1, first[..., None]).squeeze(-1).double() - h
    frac = ((q - c_before) / h.clamp(min=1)).clamp(0.0, 1.0)
    return (lo + (first.double() + frac) * width).float()


def estimate_bias_histogram(
    scores: torch.Tensor,
    cutoff: torch.Tensor,
    k: int,
    current_bias: torch.Tensor,
    num_bins: int = DEFAULT_NUM_BINS,
    center: bool = True,
) -> torch.Tensor:
    """Histogram estimate of :func:`exact_bias` for one batch (``current_bias`` is the bias ``cutoff`` was taken
    with; it sets the bin range). Within one bin width of the exact ``b_hat`` per expert (before centring)."""
    n, e = scores.shape
    lo, width = bin_range(current_bias, num_bins)
    counts = histogram_counts(scores, cutoff, lo, width, num_bins)
    b_hat = histogram_bias(counts, lo, width, target_load(n, k, e))
    return _center(b_hat) if center else b_hat


def route_with_bias(scores: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of the gate's training-time selection: top-(k+1) of ``s + b``; returns ``(topk_indices [N, k],
    cutoff [N])``. Used by tests and examples with synthetic scores."""
    values, indices = (scores.float() + bias.float()).topk(k + 1, dim=-1)
    return indices[:, :k], values[:, k]


def expert_loads(topk_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert (int64 ``[E]``)."""
    return torch.bincount(topk_indices.reshape(-1).long(), minlength=num_experts)[:num_experts]


def load_imbalance(loads: torch.Tensor) -> float:
    """``max / mean`` of the expert loads (1.0 is perfectly balanced)."""
    loads = loads.double()
    mean = loads.mean()
    return float(loads.max() / mean) if mean > 0 else float("nan")


# ----------------------------------------------------------------------------------------------------------------------
# Model side
def _in_checkpoint_recompute() -> bool:
    # Non-reentrant and reentrant checkpointing both recompute inside the backward graph task.
    return torch._C._current_graph_task_id() != -1


def find_router_gates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every ``KimiK3MoEGate`` of ``model`` (matched by class name, so remote-code copies loaded from
    ``transformers_modules.*`` count too), in module order."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if type(module).__name__ == GATE_CLASS_NAME and hasattr(module, BIAS_NAME)
    ]


def _gate_shape(gate: nn.Module) -> tuple[int, int]:
    """``(num_experts, top_k)`` of a gate."""
    top_k = getattr(gate, "top_k", None)
    if not isinstance(top_k, int):
        top_k = getattr(getattr(gate, "config", None), "num_experts_per_token", None)
    if not isinstance(top_k, int):
        raise ValueError(f"cannot find top_k of gate {type(gate).__name__} (no top_k, no config.num_experts_per_token)")
    return getattr(gate, BIAS_NAME).numel(), top_k


class _GateObserver:
    """The callable stored on a gate as ``quantile_balancing_observer``."""

    def __init__(self, balancer: "QuantileBalancer", index: int):
        self.balancer = balancer
        self.index = index

    def __call__(self, module, scores, cutoff, routed, token_mask=None):
        self.balancer._observe(self.index, module, scores, cutoff, routed, token_mask)


@dataclass
class BalancerStats:
    """What one :meth:`QuantileBalancer.step` saw and did (global over ranks)."""

    tokens: int
    loads: torch.Tensor  # [L, E] tokens routed per expert during the step (top-k of s + b)
    layer_imbalance: list[float] = field(default_factory=list)  # max/mean load per gate
    bias_abs_max: float = 0.0

    @property
    def load_imbalance(self) -> float:
        """Mean over gates of max/mean expert load."""
        vals = [v for v in self.layer_imbalance if not math.isnan(v)]
        return sum(vals) / len(vals) if vals else float("nan")

    @property
    def load_imbalance_max(self) -> float:
        vals = [v for v in self.layer_imbalance if not math.isnan(v)]
        return max(vals) if vals else float("nan")

    def as_logs(self, prefix: str = "qb/") -> dict[str, float]:
        return {
            f"{prefix}load_imbalance": self.load_imbalance,
            f"{prefix}load_imbalance_max": self.load_imbalance_max,
            f"{prefix}bias_abs_max": self.bias_abs_max,
        }


class QuantileBalancer:
    """Quantile Balancing for every ``KimiK3MoEGate`` of a model.

    Construction attaches an observer to each gate (``gate.quantile_balancing_observer``) and sets
    ``gate.config.quantile_balancing = True`` so that gates in training mode take top-(k+1) and report
    ``(scores, cutoff, token_mask)``. Each observed forward adds its tokens to per-expert histograms of
    ``r = alpha - s``; calls made while autograd recomputes a checkpointed layer are ignored, so every token counts
    once. :meth:`step` (call it after ``optimizer.step()``, once per optimizer step, on every rank) all-reduces the
    integer histograms once (when ``torch.distributed`` is initialised), writes the new mean-centred biases into the
    ``e_score_correction_bias`` buffers in place under ``no_grad`` and clears the histograms. The new bias is
    therefore used from the next step on.

    Args:
        model: the model (``KimiK3ForCausalLM``, the multimodal wrapper, or a PEFT wrapper of either).
        num_bins: histogram bins B (default: ``config.quantile_balancing_bins`` of the gates, else 512).
        ema: optional smoothing ``b <- ema * b_old + (1 - ema) * b_new`` (0 = the plain update).
        process_group: group for the all-reduce (default: the world, when initialised).
        set_config: set ``config.quantile_balancing = True`` on the gates' configs (restored by :meth:`remove`).
    """

    def __init__(
        self,
        model: nn.Module,
        num_bins: int | None = None,
        ema: float = 0.0,
        process_group=None,
        set_config: bool = True,
    ):
        self.gates = find_router_gates(model)
        if not self.gates:
            raise ValueError(f"no {GATE_CLASS_NAME} found in the model: nothing to balance")
        shapes = {_gate_shape(g) for _, g in self.gates}
        if len(shapes) != 1:
            raise ValueError(f"all gates must have the same (num_experts, top_k), got {sorted(shapes)}")
        self.num_experts, self.top_k = shapes.pop()
        if not 0 < self.top_k < self.num_experts:
            raise ValueError("Quantile Balancing needs top_k + 1 <= num_experts (top-(k+1) routing)")
        if num_bins is None:
            num_bins = getattr(getattr(self.gates[0][1], "config", None), "quantile_balancing_bins", None)
        self.num_bins = int(num_bins or DEFAULT_NUM_BINS)
        if self.num_bins < 2:
            raise ValueError("num_bins must be >= 2")
        if not 0.0 <= ema < 1.0:
            raise ValueError("ema must be in [0, 1)")
        self.ema = float(ema)
        self.process_group = process_group
        self.enabled = True
        self.num_steps = 0
        self.last_stats: BalancerStats | None = None
        # [L, E, B + 1] int64: histogram of r per gate and expert, last column = tokens routed to the expert.
        self._counts: torch.Tensor | None = None
        self._warned_silent = False

        for name, gate in self.gates:
            if getattr(gate, OBSERVER_ATTR, None) is not None:
                raise ValueError(f"gate {name} already has a {OBSERVER_ATTR}")
        self._saved_config: list[tuple[object, object]] = []
        if set_config:
            seen = set()
            for _, gate in self.gates:
                config = getattr(gate, "config", None)
                if config is None or id(config) in seen:
                    continue
                seen.add(id(config))
                self._saved_config.append((config, getattr(config, "quantile_balancing", None)))
                config.quantile_balancing = True
        for index, (_, gate) in enumerate(self.gates):
            setattr(gate, OBSERVER_ATTR, _GateObserver(self, index))

    # ---- observation -------------------------------------------------------------------------------------------
    def _buffer(self, device) -> torch.Tensor:
        if self._counts is None:
            self._counts = torch.zeros(
                len(self.gates), self.num_experts, self.num_bins + 1, dtype=torch.long, device=device
            )
        elif self._counts.device != torch.device(device):  # model moved between micro-batches
            self._counts = self._counts.to(device)
        return self._counts

    @torch.no_grad()
    def _observe(self, index, module, scores, cutoff, routed, token_mask):
        if not self.enabled or _in_checkpoint_recompute():
            return
        if token_mask is not None:
            token_mask = token_mask.reshape(-1).bool()
            scores, cutoff, routed = scores[token_mask], cutoff[token_mask], routed[token_mask]
        scores = scores.detach().float()
        cutoff = cutoff.detach().float()
        bias = getattr(module, BIAS_NAME).detach().float()
        lo, width = bin_range(bias, self.num_bins)
        counts = self._buffer(scores.device)
        counts[index, :, : self.num_bins] += histogram_counts(scores, cutoff, lo, width, self.num_bins)
        # The gate's own top-k, not "biased score above the cutoff": a tie at the k-th place routes one of the tied
        # experts, which the comparison would drop.
        counts[index, :, self.num_bins] += expert_loads(routed, self.num_experts).to(counts.device)

    # ---- update ------------------------------------------------------------------------------------------------
    def _all_reduce(self, counts: torch.Tensor) -> torch.Tensor:
        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size(self.process_group)
            if world > 1:
                dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=self.process_group)
        return counts

    @torch.no_grad()
    def step(self) -> BalancerStats | None:
        """Update every gate's bias from the tokens observed since the last call; returns the step's statistics
        (``None`` when no token was observed on any rank). Call on every rank: it does one collective."""
        buffers = [getattr(gate, BIAS_NAME) for _, gate in self.gates]
        counts = self._counts if self._counts is not None else self._buffer(buffers[0].device)
        counts = self._all_reduce(counts)
        self._counts = None
        hist, loads = counts[..., : self.num_bins], counts[..., self.num_bins]  # [L, E, B], [L, E]
        tokens = hist[:, 0].sum(-1)  # [L] (every token adds one count to each expert's row)
        current = torch.stack([b.detach().float().to(counts.device) for b in buffers])  # [L, E]
        lo, width = bin_range(current, self.num_bins)
        b_hat = histogram_bias(hist, lo, width, tokens.double() * self.top_k / self.num_experts)
        new = b_hat - b_hat.mean(-1, keepdim=True)
        if self.ema:
            new = self.ema * current + (1.0 - self.ema) * new
        tokens = tokens.cpu()
        if int(tokens.max()) == 0:
            if self.enabled and not self._warned_silent:
                warnings.warn(
                    "QuantileBalancer saw no router call during this step: the gates did not call "
                    f"`{OBSERVER_ATTR}` (is the model in train mode, and does its gate read "
                    "`config.quantile_balancing`?). Biases are left unchanged.",
                    stacklevel=2,
                )
                self._warned_silent = True
            return None
        for buffer, row, n in zip(buffers, new, tokens.tolist()):
            if n > 0:  # a gate that saw no token keeps its bias
                buffer.copy_(row.to(buffer.device, buffer.dtype))
        loads = loads.cpu()
        seen = tokens > 0
        self.num_steps += 1
        self.last_stats = BalancerStats(
            tokens=int(tokens.max()),
            loads=loads,
            layer_imbalance=[load_imbalance(row) if n > 0 else float("nan") for row, n in zip(loads, tokens)],
            bias_abs_max=float(new[seen.to(new.device)].abs().max()),
        )
        return self.last_stats

    def reset(self) -> None:
        """Drop what was observed since the last :meth:`step` (e.g. after an evaluation run in train mode)."""
        self._counts = None

    def remove(self) -> None:
        """Detach the observers and restore ``config.quantile_balancing``."""
        for _, gate in self.gates:
            if isinstance(getattr(gate, OBSERVER_ATTR, None), _GateObserver):
                setattr(gate, OBSERVER_ATTR, None)
        for config, value in self._saved_config:
            config.quantile_balancing = bool(value) if value is not None else False
        self._saved_config = []
        self.enabled = False


class ExpertLoadMonitor:
    """Counts the experts each gate routes to (``topk_indices`` of the gate's output) through forward hooks.

    Works with and without Quantile Balancing (it reads the gate's output, not the observer); checkpoint
    recomputation is not counted. ``pop()`` returns ``[L, E]`` loads since the last ``pop()``.
    """

    def __init__(self, model: nn.Module):
        self.gates = find_router_gates(model)
        if not self.gates:
            raise ValueError(f"no {GATE_CLASS_NAME} found in the model")
        self._loads: list[torch.Tensor | None] = [None] * len(self.gates)
        self._handles = [gate.register_forward_hook(self._hook(i)) for i, (_, gate) in enumerate(self.gates)]
        self.history: list[torch.Tensor] = []

    def _hook(self, index):
        def hook(module, args, output):
            if _in_checkpoint_recompute() or not module.training:
                return
            topk_indices = output[2]
            num_experts = getattr(module, BIAS_NAME).numel()
            loads = expert_loads(topk_indices.detach(), num_experts)  # stays on the device until pop()
            self._loads[index] = loads if self._loads[index] is None else self._loads[index] + loads

        return hook

    def pop(self) -> torch.Tensor:
        num_experts = getattr(self.gates[0][1], BIAS_NAME).numel()
        loads = torch.stack(
            [x.cpu() if x is not None else torch.zeros(num_experts, dtype=torch.long) for x in self._loads]
        )
        self._loads = [None] * len(self.gates)
        self.history.append(loads)
        return loads

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def mean_load_imbalance(loads: torch.Tensor) -> float:
    """Mean over gates of ``max / mean`` expert load for ``[L, E]`` loads."""
    return sum(load_imbalance(row) for row in loads) / loads.shape[0]


# ----------------------------------------------------------------------------------------------------------------------
# Trainer integration
try:
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - transformers is a dependency of the package
    TrainerCallback = object


class QuantileBalancingCallback(TrainerCallback):
    """Switch Quantile Balancing on in a ``transformers.Trainer``::

        trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[QuantileBalancingCallback()])
        # or: trainer.add_callback(QuantileBalancingCallback())

    At ``on_train_begin`` it attaches a :class:`QuantileBalancer` to the model (which sets
    ``config.quantile_balancing = True``); at every ``on_step_end`` (after the optimizer step, once per gradient-
    accumulation cycle) it updates the biases, so they apply from the next step; at each training log it adds
    ``qb/load_imbalance`` (mean over MoE layers of max/mean expert load, averaged over the steps since the last log),
    ``qb/load_imbalance_max`` and ``qb/bias_abs_max`` to the logged values (``trainer.state.log_history`` and the
    integrations that run after it). ``on_train_end`` detaches the observers and restores the config flag, so the
    saved config keeps ``quantile_balancing = False``.

    The biases are persistent buffers, so ``save_pretrained`` of a full fine-tune keeps them. A PEFT adapter does not
    hold buffers: save ``router_bias_state_dict(model)`` next to it.
    """

    def __init__(self, num_bins: int | None = None, ema: float = 0.0):
        self.num_bins = num_bins
        self.ema = ema
        self.balancer: QuantileBalancer | None = None
        self.history: list[dict[str, float]] = []  # one entry per optimizer step
        self._since_log: list[BalancerStats] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.balancer is None:
            if model is None:
                raise ValueError("QuantileBalancingCallback needs the model (Trainer passes it)")
            self.balancer = QuantileBalancer(model, num_bins=self.num_bins, ema=self.ema)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.balancer is None:
            return control
        stats = self.balancer.step()
        if stats is not None:
            self._since_log.append(stats)
            self.history.append({"step": state.global_step, **stats.as_logs(prefix="")})
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or not self._since_log:
            return control
        n = len(self._since_log)
        extra = {
            "qb/load_imbalance": sum(s.load_imbalance for s in self._since_log) / n,
            "qb/load_imbalance_max": max(s.load_imbalance_max for s in self._since_log),
            "qb/bias_abs_max": self._since_log[-1].bias_abs_max,
        }
        self._since_log = []
        logs.update(extra)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.balancer is not None:
            self.balancer.remove()
            self.balancer = None
        return control


class ExpertLoadCallback(TrainerCallback):
    """Records the expert-load imbalance (max/mean, mean over MoE layers) of every optimizer step in
    ``self.imbalance``, with or without balancing (an :class:`ExpertLoadMonitor` on the gates' routed top-k)."""

    def __init__(self):
        self.monitor: ExpertLoadMonitor | None = None
        self.imbalance: list[float] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.monitor is None:
            self.monitor = ExpertLoadMonitor(model)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.imbalance.append(mean_load_imbalance(self.monitor.pop()))
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.remove()
            self.monitor = None
        return control


def router_bias_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{name: e_score_correction_bias}`` of every gate (names as in ``model.state_dict()``)."""
    return {f"{name}.{BIAS_NAME}": getattr(g, BIAS_NAME).detach().clone() for name, g in find_router_gates(model)}


@torch.no_grad()
def load_router_bias_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Write biases saved by :func:`router_bias_state_dict` back (names must match)."""
    gates = dict(find_router_gates(model))
    for key, value in state.items():
        name = key[: -len(BIAS_NAME) - 1]
        if name not in gates:
            raise KeyError(f"no gate {name!r} in the model")
        getattr(gates[name], BIAS_NAME).copy_(value)


__all__ = [
    "BalancerStats",
    "ExpertLoadCallback",
    "ExpertLoadMonitor",
    "QuantileBalancer",
    "QuantileBalancingCallback",
    "bin_range",
    "estimate_bias_histogram",
    "exact_bias",
    "expert_loads",
    "find_router_gates",
    "histogram_bias",
    "histogram_counts",
    "load_imbalance",
    "load_router_bias_state_dict",
    "mean_load_imbalance",
    "required_bias",
    "route_with_bias",
    "router_bias_state_dict",
    "target_load",
]
