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
"""Measuring what a forward keeps alive for backward (activation memory), on any device, CPU included.

:class:`ActivationMeter` counts, as unique storages in bytes:

* every tensor autograd saves for backward during the forward (``torch.autograd.graph.saved_tensors_hooks``),
  except parameters and buffers (they exist anyway);
* with activation checkpointing, the tensors a checkpointed layer keeps as its inputs (what the non-reentrant
  checkpoint holds to recompute the layer; tensors saved *inside* the checkpointed region go to the checkpoint's own
  hooks and are dropped, which is the point).

Saved views count with their whole storage (what really stays allocated); a storage saved several times counts
once. Weight copies made by autocast (bf16 casts of f32 weights) do count: they stay alive until backward.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


def _storage_key(t: torch.Tensor):
    storage = t.untyped_storage()
    return (t.device.type, t.device.index, storage.data_ptr()), storage.nbytes()


class ActivationMeter:
    """``with ActivationMeter(model) as meter: loss = model(**batch).loss`` then ``meter.total_bytes``.

    Attributes after the block: ``saved_bytes`` (tensors saved by autograd outside checkpointed regions),
    ``checkpoint_input_bytes`` (inputs kept by checkpointed layers, not already counted), ``total_bytes`` and
    ``checkpointed_calls`` (how many checkpointed layer calls happened: 0 means checkpointing was not active).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._seen: dict = {}  # storage key -> (bytes, "saved" | "checkpoint_input")
        self._exclude: set = set()
        self.checkpointed_calls = 0
        self._patched: list[tuple[nn.Module, object]] = []
        self._hooks = None

    # ---- results ---------------------------------------------------------------------------------------------
    @property
    def saved_bytes(self) -> int:
        return sum(n for n, kind in self._seen.values() if kind == "saved")

    @property
    def checkpoint_input_bytes(self) -> int:
        return sum(n for n, kind in self._seen.values() if kind == "checkpoint_input")

    @property
    def total_bytes(self) -> int:
        return sum(n for n, _ in self._seen.values())

    # ---- recording -------------------------------------------------------------------------------------------
    def _record(self, t, kind):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
            return
        key, nbytes = _storage_key(t)
        if key in self._exclude or key in self._seen:
            return
        self._seen[key] = (nbytes, kind)

    def _pack(self, t):
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward
            self._record(t, "saved")
        return t

    @staticmethod
    def _unpack(t):
        return t

    def _wrap(self, fn):
        @functools.wraps(fn)
        def wrapper(function, *args, **kwargs):
            if torch._C._current_graph_task_id() == -1 and torch.is_grad_enabled():
                self.checkpointed_calls += 1
                inputs = list(args) + list(kwargs.values())
                if isinstance(function, functools.partial):
                    inputs += list(function.args) + list(function.keywords.values())
                for value in inputs:
                    if isinstance(value, (list, tuple)):
                        for v in value:
                            self._record(v, "checkpoint_input")
                    else:
                        self._record(value, "checkpoint_input")
            return fn(function, *args, **kwargs)

        return wrapper

    def __enter__(self):
        self._seen, self.checkpointed_calls = {}, 0
        self._exclude = set()
        for tensor in list(self.model.parameters()) + list(self.model.buffers()):
            self._exclude.add(_storage_key(tensor)[0])
        for module in self.model.modules():
            fn = module.__dict__.get("_gradient_checkpointing_func")
            if fn is not None:
                self._patched.append((module, fn))
                module._gradient_checkpointing_func = self._wrap(fn)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for module, fn in self._patched:
            module._gradient_checkpointing_func = fn
        self._patched = []
        return False


def measure_activation_bytes(model: nn.Module, batch: dict) -> ActivationMeter:
    """Run one training forward on ``batch`` (no backward) and return the meter."""
    with ActivationMeter(model) as meter:
        out = model(**batch)
    del out
    return meter


__all__ = ["ActivationMeter", "measure_activation_bytes"]
