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
"""Kimi K3 vision tower + projector: time and peak memory for one 1024x1024 image and a batch of 8.

GPU (default): the release's vision config (27 blocks, width 1024, projector to 7168), random bf16 weights, on CUDA.
A 1024x1024 image becomes 1036x1036 after padding to 28: 74x74 = 5476 patches, 37x37 = 1369 tokens.
`--quick`: a tiny tower on CPU, one JSON line (a smoke test of this script).
Prints one JSON line per case: {"case", "images", "patches", "tokens", "ms", "peak_gib", ...}.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _k3bench_utils import ensure_kimik3  # noqa: E402

ensure_kimik3()
from kimik3.configuration import released_config_dict  # noqa: E402
from kimik3.modeling.configuration_kimi_k3 import KimiK3VisionConfig  # noqa: E402
from kimik3.modeling.image_processing_kimi_k3 import resize_plan, DEFAULT_MEDIA_PROC_CFG  # noqa: E402
from kimik3.modeling.vision_kimi_k3 import KimiK3PatchMergerProjector, KimiK3VisionTower  # noqa: E402


def build(vision: dict, device, dtype):
    config = KimiK3VisionConfig(**vision)
    tower = KimiK3VisionTower(config).to(device=device, dtype=dtype)
    projector = KimiK3PatchMergerProjector(config).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in list(tower.parameters()) + list(projector.parameters()):
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return tower.eval(), projector.eval()


def measure(tower, projector, images: int, rows: int, cols: int, patch: int, device, dtype, repeats: int):
    pixels = torch.randn(images * rows * cols, 3, patch, patch, device=device, dtype=dtype)
    grid = [(1, rows, cols)] * images
    cuda = device.type == "cuda"

    def run():
        with torch.no_grad():
            return projector(tower(pixels, grid))

    run()  # warm-up
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(repeats):
        out = run()
    if cuda:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / repeats * 1e3
    tokens = sum(o.shape[0] for o in out)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return {"images": images, "patches": images * rows * cols, "tokens": tokens, "ms": round(ms, 3),
            "peak_gib": None if peak is None else round(peak, 3), "tokens_per_s": round(tokens / ms * 1e3, 1)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny tower on CPU, one JSON line")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.quick:
        vision = dict(released_config_dict()["vision_config"], vt_hidden_size=32, vt_intermediate_size=64,
                      vt_num_attention_heads=2, qkv_hidden_size=32, vt_num_hidden_layers=2, patch_size=4,
                      init_pos_emb_height=4, init_pos_emb_width=4, mm_hidden_size=32, text_hidden_size=64)
        tower, projector = build(vision, torch.device("cpu"), torch.float32)
        result = measure(tower, projector, 2, 8, 8, 4, torch.device("cpu"), torch.float32, 1)
        print(json.dumps({"case": "quick-cpu", **result}))
        return 0
    if not torch.cuda.is_available():
        print("bench_vision: error: needs a CUDA device (use --quick for the CPU smoke run)", file=sys.stderr)
        return 2
    device, dtype = torch.device("cuda"), torch.bfloat16
    vision = released_config_dict()["vision_config"]
    tower, projector = build(vision, device, dtype)
    weights_gib = torch.cuda.memory_allocated() / 2**30
    plan = resize_plan(1024, 1024, DEFAULT_MEDIA_PROC_CFG)
    patch = vision["patch_size"]
    rows, cols = (plan["new_height"] + plan["pad_height"]) // patch, (plan["new_width"] + plan["pad_width"]) // patch
    for images in (1, 8):
        result = measure(tower, projector, images, rows, cols, patch, device, dtype, args.repeats)
        print(json.dumps({"case": f"1024x1024 x{images}", "weights_gib": round(weights_gib, 3),
                          "device": torch.cuda.get_device_name(), **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
