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
"""The one door by which a folder becomes a model (docs/design.md, Loading the release layout): every class's
`from_pretrained`, our layout or the release's, with the load options of its own (`experts_format`,
`experts_offload`, `experts_cache_bytes`, `experts_compute`) and transformers' (device_map, tp_plan,
distributed_config...). The model classes hand it transformers' own `from_pretrained` and know nothing of how the
files become weights."""

from .release_layout_kimi_k3 import check_release_load, meta_skeleton
from .experts_format_kimi_k3 import OFFER_ADAPTER_POINTS, is_experts_module
from .offload_kimi_k3 import check_offload_request, load_with_experts_offloaded
from .parallel_kimi_k3 import PARALLEL_LOAD_KWARGS


def load_pretrained(model_class, transformers_load, path, *args, experts_format: str | None = None,
                    experts_offload: str | None = None, experts_cache_bytes: int | None = None,
                    experts_compute: str | None = None, **kwargs):
    """`transformers_load(path, *args, **kwargs)` (the class's transformers `from_pretrained`) through: the folder's
    files checked first, the release layout converted as it loads (release_layout_kimi_k3.check_release_load), the routed
    experts kept off the device when asked (offload_kimi_k3), and each experts module's adapter points placed beside
    its tensors (none under a parallel load)."""
    check_offload_request(experts_offload, experts_cache_bytes, kwargs, path, experts_compute)
    load = transformers_load
    if experts_offload is not None:
        def load(load_path, *load_args, **load_kwargs):
            # the config the load uses (resolved by the release loader), its expert modules kept off the device
            names = _experts_module_names(model_class, load_path, load_kwargs)
            return load_with_experts_offloaded(transformers_load, model_class, load_path, load_args, load_kwargs,
                                               experts_offload, experts_cache_bytes, names, experts_compute)

    points = OFFER_ADAPTER_POINTS.set(not any(kwargs.get(key) is not None for key in PARALLEL_LOAD_KWARGS))
    try:
        loaded = check_release_load(load, model_class, path, *args, experts_format=experts_format, **kwargs)
    finally:
        OFFER_ADAPTER_POINTS.reset(points)
    for module in (loaded[0] if isinstance(loaded, tuple) else loaded).modules():
        if is_experts_module(module):
            module.place_adapter_points()
    return loaded


def _experts_module_names(model_class, path, load_kwargs) -> list[str]:
    """The routed-expert modules' names in the model this load builds, from a skeleton on the meta device (no
    memory, no weights read)."""
    config = load_kwargs.get("config")
    if config is None or isinstance(config, str):
        hub = {key: load_kwargs[key] for key in ("cache_dir", "revision", "token", "local_files_only", "subfolder")
               if key in load_kwargs}
        config = model_class.config_class.from_pretrained(config or path, **hub)
    return [name for name, module in meta_skeleton(model_class, config).named_modules() if is_experts_module(module)]


__all__ = ["load_pretrained"]
