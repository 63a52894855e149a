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
"""Kimi K3 vision: the MoonViT-3d tower (`vision_tower.*`) and the PatchMergerMLPV2 projector (`mm_projector.*`).

Images arrive as flattened patches, `pixel_values` [sum(t*h*w), 3, p, p], with `grid_thws` [images, 3] giving each
image's (frames, patch rows, patch columns); patches are in row-major order within each frame. The tower:

  patch conv -> + learnable 2-D position grid (bilinearly resized to h x w unless it already is) [+ a fixed sin-cos
  time term per frame when t > 1] -> blocks (RMSNorm, 2-D RoPE attention within each image, RMSNorm, GELU-tanh MLP)
  -> final RMSNorm -> mean over frames, 2x2 neighbourhoods gathered into [h/2 * w/2, 4, width].

The projector flattens each 2x2 group (4 * width), Linear -> exact GELU -> Linear to the text width -> RMSNorm.

Dtype policy (as the release, which casts tower and projector to the language model's dtype): weights and
activations in the model dtype (bf16), with f32 islands where the release computes in f32: the rotary rotation, the
position-grid interpolation (computed in f32, rounded once) and every RMS statistic (torch's `rms_norm`). The tower's
RMSNorms are built without eps, so `rms_norm` picks its own default (the f32 machine epsilon in torch 2.x, also for
bf16 inputs, whose statistic is computed in f32).
"""

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


# The rotary table covers grids up to this many patches per side (the processor caps a side at 512 patches).
ROPE_MAX_GRID = 512
ROPE_THETA = 10000.0


def vision_setting(config, key: str):
    """A vision config field, with a clear error naming it when the config lacks it."""
    if not hasattr(config, key):
        raise ValueError(f"Kimi K3 config, key `vision_config.{key}`: missing, the vision tower needs it")
    return getattr(config, key)


def merge_kernel(config) -> tuple[int, int]:
    kernel = vision_setting(config, "merge_kernel_size")
    if isinstance(kernel, int):
        return kernel, kernel
    return int(kernel[0]), int(kernel[1])


class KimiK3VisionRMSNorm(nn.Module):
    """torch's RMSNorm (statistic in f32, cast back, then times the weight); `eps=None` as the release builds the
    tower's norms."""

    def __init__(self, hidden_size: int, eps: float | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def sincos_time_table(dim: int, frames: int) -> torch.Tensor:
    """[frames, dim] fixed time embedding: row f is [sin(f * w_i) | cos(f * w_i)], w_i = 10000^(-i / (dim/2)),
    evaluated in f32 (numpy, as the release builds it)."""
    half = dim // 2
    exponent = np.arange(half, dtype=np.float32) / np.float32(half)
    inv_freq = np.float32(1.0) / np.power(np.float32(10000.0), exponent)
    angles = np.outer(np.arange(frames, dtype=np.float32), inv_freq).astype(np.float32)
    return torch.from_numpy(np.concatenate([np.sin(angles), np.cos(angles)], axis=1).astype(np.float32))


class KimiK3VisionPositionEmbedding(nn.Module):
    """The learnable [H0, W0, width] grid (`pos_emb.weight`) resized to each image's grid, plus the time table."""

    def __init__(self, height: int, width: int, frames: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(height, width, dim))
        self.max_frames = frames

    def grid(self, rows: int, cols: int) -> torch.Tensor:
        """[rows * cols, width] in the weight's dtype."""
        if (rows, cols) == tuple(self.weight.shape[:2]):
            return self.weight.reshape(rows * cols, -1)
        # bilinear, half-pixel centres (align_corners=False); computed in f32 and rounded once
        grid = self.weight.float().permute(2, 0, 1).unsqueeze(0)
        resized = F.interpolate(grid, size=(rows, cols), mode="bilinear", align_corners=False)
        return resized[0].permute(1, 2, 0).reshape(rows * cols, -1).to(self.weight.dtype)

    def forward(self, grid_thws: list[tuple[int, int, int]]) -> torch.Tensor:
        pieces = []
        for frames, rows, cols in grid_thws:
            if frames > self.max_frames:
                raise ValueError(f"grid_thws: {frames} frames, the vision tower's time embedding has "
                                 f"{self.max_frames} (vision_config.init_pos_emb_time)")
            spatial = self.grid(rows, cols)
            if frames > 1:
                # built in f32 (no buffer: from_pretrained builds modules on the meta device); the release casts
                # its copy to the tower dtype with the rest of the module
                table = sincos_time_table(self.weight.shape[-1], self.max_frames)[:frames]
                time = table.to(device=spatial.device, dtype=spatial.dtype)
                spatial = (spatial.unsqueeze(0) + time.unsqueeze(1)).reshape(frames * rows * cols, -1)
            pieces.append(spatial)
        return torch.cat(pieces)


class KimiK3VisionPatchEmbed(nn.Module):
    def __init__(self, config):
        super().__init__()
        patch = vision_setting(config, "patch_size")
        width = vision_setting(config, "vt_hidden_size")
        bias = bool(getattr(config, "patch_embed_proj_bias", False))
        self.proj = nn.Conv2d(3, width, kernel_size=patch, stride=patch, bias=bias)
        self.pos_emb = KimiK3VisionPositionEmbedding(
            vision_setting(config, "init_pos_emb_height"),
            vision_setting(config, "init_pos_emb_width"),
            getattr(config, "init_pos_emb_time", 4),
            width,
        )

    def forward(self, pixel_values: torch.Tensor, grid_thws) -> torch.Tensor:
        patches = self.proj(pixel_values).reshape(pixel_values.shape[0], -1)
        return patches + self.pos_emb(grid_thws)


def rotary_angles(rows: int, cols: int, head_dim: int, device) -> torch.Tensor:
    """[rows * cols, head_dim / 2] f32 rotation angles: pair 2i turns by col * theta_i, pair 2i+1 by row * theta_i,
    theta_i = 10000^(-4i / head_dim) (the release's 2-D RoPE; its docstring swaps the axes, its code does this)."""
    exponents = torch.arange(0, head_dim, 4, device=device)[: head_dim // 4].float() / head_dim
    inv_freq = 1.0 / (ROPE_THETA ** exponents)
    col = torch.arange(cols, device=device).float().repeat(rows)
    row = torch.arange(rows, device=device).float().repeat_interleave(cols)
    return torch.stack([torch.outer(col, inv_freq), torch.outer(row, inv_freq)], dim=-1).reshape(rows * cols, -1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates consecutive (even, odd) channel pairs of x [tokens, heads, head_dim] in f32; cos/sin [tokens, pairs]."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    real, imag = pairs[..., 0], pairs[..., 1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return rotated.reshape(x.shape).to(x.dtype)


class KimiK3VisionMLP(nn.Module):
    def __init__(self, width: int, intermediate: int, bias: bool):
        super().__init__()
        self.fc0 = nn.Linear(width, intermediate, bias=bias)
        self.fc1 = nn.Linear(intermediate, width, bias=bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(hidden_states), approximate="tanh"))


class KimiK3VisionEncoderLayer(nn.Module):
    """Pre-norm block; attention is `qkv_hidden_size` wide (wider than the residual stream in the release)."""

    def __init__(self, config):
        super().__init__()
        width = vision_setting(config, "vt_hidden_size")
        self.num_heads = vision_setting(config, "vt_num_attention_heads")
        self.attention_width = getattr(config, "qkv_hidden_size", width)
        self.head_dim = self.attention_width // self.num_heads
        attn_bias = bool(getattr(config, "attn_bias", False))
        self.norm0 = KimiK3VisionRMSNorm(width)
        self.norm1 = KimiK3VisionRMSNorm(width)
        self.wqkv = nn.Linear(width, 3 * self.attention_width, bias=attn_bias)
        self.wo = nn.Linear(self.attention_width, width, bias=attn_bias)
        self.mlp = KimiK3VisionMLP(width, vision_setting(config, "vt_intermediate_size"),
                                   bool(getattr(config, "linear_bias", False)))

    def forward(self, hidden_states, cos, sin, image_lengths: list[int]) -> torch.Tensor:
        hidden_states = hidden_states + self._attention(self.norm0(hidden_states), cos, sin, image_lengths)
        return hidden_states + self.mlp(self.norm1(hidden_states))

    def _attention(self, hidden_states, cos, sin, image_lengths):
        tokens = hidden_states.shape[0]
        qkv = self.wqkv(hidden_states).view(tokens, 3, self.num_heads, self.head_dim)
        query, key, value = qkv.unbind(dim=1)
        query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
        # Each image attends only to itself (the release's varlen attention); equal-length images run as one batch.
        outputs = []
        start = 0
        for length, count in _runs(image_lengths):
            span = slice(start, start + length * count)
            q, k, v = (t[span].reshape(count, length, self.num_heads, self.head_dim).transpose(1, 2)
                       for t in (query, key, value))
            out = F.scaled_dot_product_attention(q, k, v)
            outputs.append(out.transpose(1, 2).reshape(length * count, self.attention_width))
            start += length * count
        return self.wo(torch.cat(outputs) if len(outputs) > 1 else outputs[0])


def _runs(lengths: list[int]) -> list[tuple[int, int]]:
    """Consecutive equal lengths grouped: [4, 4, 9] -> [(4, 2), (9, 1)]."""
    runs = []
    for length in lengths:
        if runs and runs[-1][0] == length:
            runs[-1] = (length, runs[-1][1] + 1)
        else:
            runs.append((length, 1))
    return runs


class KimiK3VisionEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.blocks = nn.ModuleList(
            KimiK3VisionEncoderLayer(config) for _ in range(vision_setting(config, "vt_num_hidden_layers"))
        )
        self.final_layernorm = KimiK3VisionRMSNorm(vision_setting(config, "vt_hidden_size"))

    def forward(self, hidden_states: torch.Tensor, grid_thws) -> torch.Tensor:
        head_dim = self.blocks[0].head_dim
        angles = torch.cat([rotary_angles(rows, cols, head_dim, hidden_states.device).repeat(frames, 1)
                            for frames, rows, cols in grid_thws])
        cos, sin = angles.cos(), angles.sin()
        lengths = [frames * rows * cols for frames, rows, cols in grid_thws]
        for block in self.blocks:
            hidden_states = block(hidden_states, cos, sin, lengths)
        return self.final_layernorm(hidden_states)


def merge_patches(hidden_states: torch.Tensor, grid_thws, kernel: tuple[int, int]) -> list[torch.Tensor]:
    """Per image [h/kh * w/kw, kh*kw, width]: frames averaged, then each kh x kw neighbourhood gathered (row-major
    inside the neighbourhood, neighbourhoods row-major over the image)."""
    kh, kw = kernel
    width = hidden_states.shape[-1]
    merged, start = [], 0
    for frames, rows, cols in grid_thws:
        image = hidden_states[start:start + frames * rows * cols]
        start += frames * rows * cols
        image = image.view(frames, rows // kh, kh, cols // kw, kw, width).permute(0, 1, 3, 2, 4, 5)
        merged.append(image.mean(dim=0).reshape((rows // kh) * (cols // kw), kh * kw, width))
    return merged


class KimiK3VisionTower(nn.Module):
    """MoonViT-3d: pixel patches -> per image [merged tokens, kh*kw, width] (the projector's input)."""

    def __init__(self, config):
        super().__init__()
        for key, expected in (("pos_emb_type", "divided_fixed"), ("merge_type", "sd2_tpool"),
                              ("norm_type", "rmsnorm"), ("mlp_type", "mlp2"),
                              ("pos_emb_interpolation_mode", "bilinear")):
            value = getattr(config, key, expected)
            if value != expected:
                raise ValueError(f"Kimi K3 config, key `vision_config.{key}`: {value!r} is not supported (the "
                                 f"release's tower uses {expected!r})")
        self.patch_size = vision_setting(config, "patch_size")
        self.merge_kernel_size = merge_kernel(config)
        self.patch_embed = KimiK3VisionPatchEmbed(config)
        self.encoder = KimiK3VisionEncoder(config)

    def forward(self, pixel_values: torch.Tensor, grid_thws) -> list[torch.Tensor]:
        hidden_states = self.patch_embed(pixel_values, grid_thws)
        hidden_states = self.encoder(hidden_states, grid_thws)
        return merge_patches(hidden_states, grid_thws, self.merge_kernel_size)


class KimiK3PatchMergerProjector(nn.Module):
    """PatchMergerMLPV2: [n, kh*kw, width] -> [n, text width]; no pre-norm, exact GELU, post RMSNorm."""

    def __init__(self, config):
        super().__init__()
        kh, kw = merge_kernel(config)
        inner = vision_setting(config, "mm_hidden_size") * kh * kw
        self.proj = nn.Sequential(
            nn.Linear(inner, inner, bias=False),
            nn.GELU(),
            nn.Linear(inner, vision_setting(config, "text_hidden_size"), bias=False),
        )
        self.post_norm = KimiK3VisionRMSNorm(vision_setting(config, "text_hidden_size"),
                                             eps=getattr(config, "projector_ln_eps", 1e-5))

    def forward(self, merged: list[torch.Tensor]) -> list[torch.Tensor]:
        lengths = [m.shape[0] for m in merged]
        flat = torch.cat([m.reshape(m.shape[0], -1) for m in merged])
        return list(self.post_norm(self.proj(flat)).split(lengths))


def check_image_inputs(pixel_values: torch.Tensor, grid_thws, patch_size: int, kernel: tuple[int, int]):
    """grid_thws as a list of int triples, after checking it against pixel_values; errors name the input."""
    if not isinstance(pixel_values, torch.Tensor) or pixel_values.dim() != 4 or pixel_values.shape[1] != 3 \
            or tuple(pixel_values.shape[2:]) != (patch_size, patch_size):
        shape = tuple(pixel_values.shape) if isinstance(pixel_values, torch.Tensor) else type(pixel_values).__name__
        raise ValueError(f"pixel_values must be patches [N, 3, {patch_size}, {patch_size}] (the image processor's "
                         f"output); got {shape}")
    if grid_thws is None:
        raise ValueError("pixel_values were given without grid_thws (frames, patch rows, patch columns per image)")
    grid = torch.as_tensor(grid_thws)
    if grid.dim() != 2 or grid.shape[1] != 3 or grid.shape[0] == 0:
        raise ValueError(f"grid_thws must be [images, 3] (frames, patch rows, patch columns); got shape "
                         f"{tuple(grid.shape)}")
    if grid.is_floating_point() or grid.is_complex() or grid.dtype == torch.bool:
        # int() would truncate 2.5 rows to 2 silently
        raise ValueError(f"grid_thws must hold whole numbers (frames, patch rows, patch columns); got dtype "
                         f"{grid.dtype}")
    triples = [tuple(int(v) for v in row) for row in grid.tolist()]
    kh, kw = kernel
    for index, (frames, rows, cols) in enumerate(triples):
        if frames < 1 or rows < kh or cols < kw or rows % kh or cols % kw or rows > ROPE_MAX_GRID \
                or cols > ROPE_MAX_GRID:
            raise ValueError(f"grid_thws[{index}] = {[frames, rows, cols]}: rows/columns must be positive multiples "
                             f"of the merge kernel {kh}x{kw}, at most {ROPE_MAX_GRID}, and frames >= 1")
    total = sum(f * r * c for f, r, c in triples)
    if total != pixel_values.shape[0]:
        raise ValueError(f"grid_thws describes {total} patches but pixel_values holds {pixel_values.shape[0]}")
    if not bool(torch.isfinite(pixel_values).all()):
        raise ValueError("pixel_values hold non-finite values (NaN/Inf)")
    return triples


__all__ = ["KimiK3PatchMergerProjector", "KimiK3VisionTower", "check_image_inputs", "merge_patches"]
