"""Vision: the MoonViT-3d tower and projector against a per-patch reference written out here, the image processor's
release rules, the placeholder splice, images through generate(), and loading the tower from a release-layout
checkpoint."""

import copy
import json
import math
import re
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from kimik3.convert import testing
from kimik3.modeling.configuration_kimi_k3 import KimiK3Config
from kimik3.modeling.image_processing_kimi_k3 import KimiK3ImageProcessor
from kimik3.modeling.multimodal_kimi_k3 import (
    KimiK3ForConditionalGeneration,
    _placeholder_runs,
    merge_image_features,
)
from k3_test_utils import cache_of

PAD_ID = testing.TINY_TOP["pad_token_id"]
MEDIA_ID = testing.TINY_TOP["media_placeholder_token_id"]


@pytest.fixture(scope="module")
def config():
    return KimiK3Config(**testing.tiny_release_config(num_layers=2, num_experts=4))


@pytest.fixture(scope="module")
def model(config):
    torch.manual_seed(0)
    m = KimiK3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # non-trivial norm weights, so a swapped weight would show
        for name, p in m.named_parameters():
            if name.startswith(("vision_tower", "mm_projector")) and name.endswith("norm0.weight"):
                p.uniform_(0.5, 1.5)
    return m


# ---------------------------------------------------------------------------------------------------------------
# Independent reference: one patch / one token at a time, float64, formulas written out (release semantics).

def _bilinear(grid, rows, cols):
    """grid [H0, W0, D] -> [rows, cols, D], half-pixel centres, edge-clamped (align_corners=False)."""
    h0, w0 = grid.shape[:2]
    out = torch.empty(rows, cols, grid.shape[2], dtype=torch.float64)
    for r in range(rows):
        y = max((r + 0.5) * h0 / rows - 0.5, 0.0)
        y0 = int(math.floor(y)); y1 = min(y0 + 1, h0 - 1); fy = y - y0
        for c in range(cols):
            x = max((c + 0.5) * w0 / cols - 0.5, 0.0)
            x0 = int(math.floor(x)); x1 = min(x0 + 1, w0 - 1); fx = x - x0
            out[r, c] = ((1 - fy) * ((1 - fx) * grid[y0, x0] + fx * grid[y0, x1])
                         + fy * ((1 - fx) * grid[y1, x0] + fx * grid[y1, x1]))
    return out


def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean() + eps) * w


def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _rotate(vec, row, col, head_dim):
    out = vec.clone()
    for i in range(head_dim // 4):
        theta = 10000.0 ** (-4 * i / head_dim)
        for pair, pos in ((2 * i, col), (2 * i + 1, row)):  # pair 2i turns with the column, 2i+1 with the row
            a, b = vec[2 * pair], vec[2 * pair + 1]
            cos, sin = math.cos(pos * theta), math.sin(pos * theta)
            out[2 * pair], out[2 * pair + 1] = a * cos - b * sin, a * sin + b * cos
    return out


def reference_image_features(model, patches, frames, rows, cols):
    vc = model.config.vision_config
    sd = {k: v.double() for k, v in model.state_dict().items() if k.startswith(("vision_tower", "mm_projector"))}
    eps32 = torch.finfo(torch.float32).eps
    width, heads = vc.vt_hidden_size, vc.vt_num_attention_heads
    head_dim = vc.qkv_hidden_size // heads
    pos = _bilinear(sd["vision_tower.patch_embed.pos_emb.weight"], rows, cols)
    conv = sd["vision_tower.patch_embed.proj.weight"]
    tokens, where = [], []
    for f in range(frames):
        for r in range(rows):
            for c in range(cols):
                patch = patches[(f * rows + r) * cols + c].double()
                x = torch.stack([(conv[o] * patch).sum() for o in range(width)]) + pos[r, c]
                if frames > 1:
                    half = width // 2
                    w = [10000.0 ** (-i / half) for i in range(half)]
                    x = x + torch.tensor([math.sin(f * v) for v in w] + [math.cos(f * v) for v in w],
                                         dtype=torch.float64)
                tokens.append(x)
                where.append((r, c))
    h = torch.stack(tokens)
    for b in range(vc.vt_num_hidden_layers):
        p = f"vision_tower.encoder.blocks.{b}."
        normed = torch.stack([_rms(t, sd[p + "norm0.weight"], eps32) for t in h])
        qkv = normed @ sd[p + "wqkv.weight"].T
        q, k, v = qkv.split(vc.qkv_hidden_size, dim=-1)
        att = torch.zeros_like(q)
        for head in range(heads):
            sl = slice(head * head_dim, (head + 1) * head_dim)
            qs = torch.stack([_rotate(q[i, sl], *where[i], head_dim) for i in range(len(h))])
            ks = torch.stack([_rotate(k[i, sl], *where[i], head_dim) for i in range(len(h))])
            for i in range(len(h)):
                scores = torch.tensor([float(qs[i] @ ks[j]) / math.sqrt(head_dim) for j in range(len(h))],
                                      dtype=torch.float64)
                weights = torch.exp(scores - scores.max())
                att[i, sl] = (weights / weights.sum()) @ v[:, sl]
        h = h + att @ sd[p + "wo.weight"].T
        for i in range(len(h)):
            n = _rms(h[i], sd[p + "norm1.weight"], eps32)
            h[i] = h[i] + sd[p + "mlp.fc1.weight"] @ _gelu_tanh(sd[p + "mlp.fc0.weight"] @ n)
    h = torch.stack([_rms(t, sd["vision_tower.encoder.final_layernorm.weight"], eps32) for t in h])
    h = h.view(frames, rows, cols, width).mean(dim=0)
    out = []
    for r in range(0, rows, 2):  # 2x2 neighbourhoods, row-major; inside one, (r, c) (r, c+1) (r+1, c) (r+1, c+1)
        for c in range(0, cols, 2):
            x = torch.cat([h[r, c], h[r, c + 1], h[r + 1, c], h[r + 1, c + 1]])
            y = sd["mm_projector.proj.0.weight"] @ x
            y = 0.5 * y * (1 + torch.erf(y / math.sqrt(2)))
            y = sd["mm_projector.proj.2.weight"] @ y
            out.append(_rms(y, sd["mm_projector.post_norm.weight"], vc.projector_ln_eps))
    return torch.stack(out)


@pytest.mark.parametrize("frames,rows,cols", [(1, 4, 6), (2, 2, 4), (1, 4, 4)])
def test_fp32_tower_and_projector_match_the_per_patch_reference(model, frames, rows, cols):
    """(1, 4, 6): the 4x4 position grid bilinearly resized; (2, 2, 4): two frames (time term, temporal mean);
    (1, 4, 4): the grid used as it is."""
    patch = model.config.vision_config.patch_size
    gen = torch.Generator().manual_seed(rows * 10 + cols + frames)
    patches = torch.randn(frames * rows * cols, 3, patch, patch, generator=gen)
    with torch.no_grad():
        ours = model.get_image_features(patches, torch.tensor([[frames, rows, cols]]))
    expected = reference_image_features(model, patches, frames, rows, cols)
    assert len(ours) == 1 and ours[0].dtype == torch.float32
    assert ours[0].shape == (rows * cols // 4, model.config.vision_config.text_hidden_size)
    torch.testing.assert_close(ours[0].double(), expected, atol=2e-5, rtol=2e-5)


def test_images_in_one_batch_do_not_attend_to_each_other(model):
    patch = model.config.vision_config.patch_size
    a, b = torch.randn(24, 3, patch, patch), torch.randn(4, 3, patch, patch)
    with torch.no_grad():
        together = model.get_image_features(torch.cat([a, b]), torch.tensor([[1, 4, 6], [1, 2, 2]]))
        alone = [model.get_image_features(a, torch.tensor([[1, 4, 6]]))[0],
                 model.get_image_features(b, torch.tensor([[1, 2, 2]]))[0]]
    for x, y in zip(together, alone):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)


def test_bad_image_inputs_name_the_problem(model):
    patch = model.config.vision_config.patch_size
    with pytest.raises(ValueError, match="describes 24 patches but pixel_values holds 20"):
        model.get_image_features(torch.randn(20, 3, patch, patch), torch.tensor([[1, 4, 6]]))
    with pytest.raises(ValueError, match="multiples of the merge kernel"):
        model.get_image_features(torch.randn(15, 3, patch, patch), torch.tensor([[1, 3, 5]]))
    with pytest.raises(ValueError, match="non-finite"):
        model.get_image_features(torch.full((4, 3, patch, patch), float("nan")), torch.tensor([[1, 2, 2]]))


# ---------------------------------------------------------------------------------------------------------------
# Image processor: the release's rules

def test_image_processor_follows_the_release_rules():
    proc = KimiK3ImageProcessor()
    img = np.random.default_rng(0).integers(0, 256, (223, 225, 3), dtype=np.uint8)
    out = proc.preprocess([Image.fromarray(img)])
    # kept at 225x223, padded to 252x224 (multiples of 28): 16 x 18 patches, 8 x 9 = 72 tokens
    assert out["grid_thws"].tolist() == [[1, 16, 18]] and out["grid_thws"].dtype == torch.int64
    assert out["pixel_values"].shape == (288, 3, 14, 14) and out["pixel_values"].dtype == torch.float32
    assert proc.num_image_tokens(225, 223) == 72
    pv = out["pixel_values"].view(16, 18, 3, 14, 14)
    # patch (r, c), channel k, pixel (i, j) is image pixel (14r + i, 14c + j), normalised (x/255 - 0.5) / 0.5
    for r, c, k, i, j in [(0, 0, 0, 0, 0), (3, 7, 2, 5, 11), (15, 15, 1, 12, 13)]:
        expected = (img[14 * r + i, 14 * c + j, k] / 255.0 - 0.5) / 0.5
        assert abs(float(pv[r, c, k, i, j]) - expected) < 1e-6
    assert float(pv[15, 17, 0, 13, 13]) == -1.0  # right/bottom zero padding -> -1 after normalising


def test_large_images_are_scaled_to_the_patch_limits():
    proc = KimiK3ImageProcessor()
    # 7200 x 100: 512 patches per side at most -> width 7168, height int(100 * 7168 / 7200) = 99 -> padded 112
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (100, 7200, 3), dtype=np.uint8))
    out = proc.preprocess([image])
    assert out["grid_thws"].tolist() == [[1, 8, 512]]
    resized = np.asarray(image.resize((7168, 99), resample=Image.Resampling.BICUBIC))
    pv = out["pixel_values"].view(8, 512, 3, 14, 14)
    assert abs(float(pv[7, 511, 2, 0, 13]) - (resized[98, 7167, 2] / 255.0 - 0.5) / 0.5) < 1e-6
    # 4000 x 4000 = 285^2 patches > 65536: scale sqrt(65536 / 285^2); int(4000 * s) = 3592 -> padded 3612 = 258 p
    assert proc.num_image_tokens(4000, 4000) == 129 * 129


# the release's fill (preprocessor_config.json: transparent_bg_config, transparent_bg_fill_stage)
RELEASE_BG = {"pattern": "chessboard", "chessboard_square_size": 8, "chessboard_square_on_top_left": True,
              "chessboard_white_value": 255, "chessboard_gray_value": 180}
RELEASE_FILL = {"transparent_bg_config": RELEASE_BG, "transparent_bg_fill_stage": "after_resize"}


def _board(x, y):
    """The release's chessboard at pixel (x, y): 8-pixel squares, white where the square's row + column is even."""
    return 180 if (x // 8 + y // 8) % 2 == 1 else 255


def _over_board(rgb, alpha, x, y):
    """One channel of one pixel composited as the release does: in f32, truncated to a byte."""
    a = np.float32(alpha) / np.float32(255)
    return int(a * np.float32(rgb) + (np.float32(1) - a) * np.float32(_board(x, y)))


def _processed_bytes(out, rows, cols, patch):
    """The padded image the processor cut into patches, back as bytes (mean = std = 0.5)."""
    pv = out["pixel_values"].double().view(rows, cols, 3, patch, patch).permute(0, 3, 1, 4, 2)
    values = ((pv.reshape(rows * patch, cols * patch, 3) * 0.5 + 0.5) * 255).numpy()
    assert np.abs(values - np.rint(values)).max() < 1e-3
    return np.rint(values).astype(np.int64)


def _transparent_image(mode, width, height, seed):
    """An image with a fully transparent left part, partly transparent pixels and an opaque rest, and its colour and
    alpha per pixel worked out here (the palette image through its palette, not through PIL's conversion)."""
    rng = np.random.default_rng(seed)
    alpha = np.full((height, width), 255, dtype=np.uint8)
    alpha[:, : width // 3] = 0
    alpha[:, width // 3: width // 2] = rng.integers(1, 255, (height, width // 2 - width // 3))
    if mode == "RGBA":
        rgb = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        return Image.fromarray(np.dstack([rgb, alpha]), mode="RGBA"), rgb, alpha
    if mode == "LA":
        grey = rng.integers(0, 256, (height, width), dtype=np.uint8)
        return Image.fromarray(np.dstack([grey, alpha]), mode="LA"), np.repeat(grey[:, :, None], 3, axis=2), alpha
    palette = rng.integers(0, 256, (256, 3), dtype=np.uint8)
    index = rng.integers(1, 256, (height, width), dtype=np.uint8)
    index[:, : width // 3] = 0  # palette entry 0 is the transparent colour
    image = Image.fromarray(index, mode="P")
    image.putpalette(palette.flatten().tolist())
    image.info["transparency"] = 0
    return image, palette[index], np.where(index == 0, 0, 255).astype(np.uint8)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparent_pixels_are_composited_onto_the_releases_chessboard(mode):
    image, rgb, alpha = _transparent_image(mode, 30, 20, seed=3)
    out = KimiK3ImageProcessor(media_proc_cfg=RELEASE_FILL).preprocess([image])
    assert out["grid_thws"].tolist() == [[1, 2, 4]]  # 30 x 20 kept, padded to 56 x 28
    got = _processed_bytes(out, 2, 4, 14)
    expected = np.zeros((28, 56, 3), dtype=np.int64)  # zero padding, no chessboard under it
    for y in range(20):
        for x in range(30):
            expected[y, x] = [_over_board(rgb[y, x, k], alpha[y, x], x, y) for k in range(3)]
    np.testing.assert_array_equal(got, expected)
    assert (got[:20, :10] != rgb[:, :10]).any()  # the transparent part shows the board, not the hidden colours


def test_the_chessboard_is_drawn_on_the_resized_image_of_premultiplied_colours():
    image, _, _ = _transparent_image("RGBA", 64, 48, seed=4)
    # 4 x 3 patches over a limit of 4: scaled by sqrt(4 / 12) to 36 x 27, padded to 56 x 28
    out = KimiK3ImageProcessor(media_proc_cfg={**RELEASE_FILL, "in_patch_limit": 4}).preprocess([image])
    assert out["grid_thws"].tolist() == [[1, 2, 4]]
    resized = np.asarray(image.resize((36, 27), resample=Image.Resampling.BICUBIC))  # PIL: alpha premultiplied
    expected = np.zeros((28, 56, 3), dtype=np.int64)
    for y in range(27):
        for x in range(36):
            expected[y, x] = [_over_board(resized[y, x, k], resized[y, x, 3], x, y) for k in range(3)]
    np.testing.assert_array_equal(_processed_bytes(out, 2, 4, 14), expected)
    # composited before resizing (the release's other stage) the board would be blurred and scaled: not the same
    before = KimiK3ImageProcessor(media_proc_cfg={**RELEASE_FILL, "in_patch_limit": 4,
                                                  "transparent_bg_fill_stage": "before_resize"}).preprocess([image])
    assert not torch.equal(before["pixel_values"], out["pixel_values"])


def test_the_fill_leaves_rgb_images_alone_and_is_off_unless_configured():
    rgb_image = _image(45, 33, seed=5)
    plain, filled = KimiK3ImageProcessor(), KimiK3ImageProcessor(media_proc_cfg=RELEASE_FILL)
    assert torch.equal(filled.preprocess([rgb_image])["pixel_values"], plain.preprocess([rgb_image])["pixel_values"])
    assert plain.media_proc_cfg["transparent_bg_config"] is None
    transparent, _, _ = _transparent_image("RGBA", 45, 33, seed=6)
    # plain construction drops alpha (the release's rule without a transparent_bg_config)
    assert torch.equal(plain.preprocess([transparent])["pixel_values"],
                       plain.preprocess([transparent.convert("RGB")])["pixel_values"])
    assert not torch.equal(filled.preprocess([transparent])["pixel_values"],
                           plain.preprocess([transparent])["pixel_values"])


@pytest.mark.parametrize("settings, named", [
    ({"transparent_bg_config": {**RELEASE_BG, "pattern": "checkerboard"}}, "transparent_bg_config.pattern = "),
    ({"transparent_bg_config": {**RELEASE_BG, "chessboard_square_size": 0}},
     "transparent_bg_config.chessboard_square_size = "),
    ({"transparent_bg_config": {**RELEASE_BG, "chessboard_gray_value": 256}},
     "transparent_bg_config.chessboard_gray_value = "),
    ({"transparent_bg_config": {**RELEASE_BG, "chessboard_square_on_top_left": "yes"}},
     "transparent_bg_config.chessboard_square_on_top_left = "),
    ({"transparent_bg_config": {**RELEASE_BG, "colour": "red"}}, "transparent_bg_config.colour is not a setting"),
    ({"transparent_bg_config": "chessboard"}, "transparent_bg_config = "),
    ({"transparent_bg_fill_stage": "during_resize"}, "transparent_bg_fill_stage = "),
], ids=["pattern", "square-size", "gray-value", "top-left", "unknown-key", "not-an-object", "stage"])
def test_bad_transparent_background_settings_are_refused_naming_the_key(settings, named):
    with pytest.raises(ValueError, match="media_proc_cfg." + re.escape(named)):
        KimiK3ImageProcessor(media_proc_cfg=settings)


# ---------------------------------------------------------------------------------------------------------------
# Splice and generate

def _features(*rows):
    return [torch.full((n, 2), float(v)) for v, n in rows]


def test_merge_expands_each_placeholder_and_repads_left():
    ids = torch.tensor([[5, MEDIA_ID, 7], [PAD_ID, MEDIA_ID, 8]])
    embeds = torch.arange(12, dtype=torch.float32).view(2, 3, 2) + 100
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    labels = torch.tensor([[5, -100, 7], [-100, -100, 8]])
    merged, merged_mask, merged_labels = merge_image_features(ids, embeds, _features((1, 3), (2, 1)), MEDIA_ID,
                                                              PAD_ID, mask, labels)
    assert merged_mask.tolist() == [[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
    assert merged[0, :, 0].tolist() == [100, 1, 1, 1, 104]
    assert merged[1, :, 0].tolist() == [0, 0, 0, 2, 110]  # pad embedding zeroed, filler zero, image, text
    assert merged_labels.tolist() == [[5, -100, -100, -100, 7], [-100, -100, -100, -100, 8]]
    # pre-expanded prompts (a run of n placeholders per image) give the same sequence
    ids2 = torch.tensor([[5, MEDIA_ID, MEDIA_ID, MEDIA_ID, 7], [PAD_ID, PAD_ID, PAD_ID, MEDIA_ID, 8]])
    emb2 = torch.zeros(2, 5, 2)
    emb2[0, 0], emb2[0, 4], emb2[1, 4] = embeds[0, 0], embeds[0, 2], embeds[1, 2]
    merged2, mask2, _ = merge_image_features(ids2, emb2, _features((1, 3), (2, 1)), MEDIA_ID, PAD_ID,
                                             torch.tensor([[1] * 5, [0, 0, 0, 1, 1]]))
    assert torch.equal(merged2, merged) and torch.equal(mask2, merged_mask)
    with pytest.raises(ValueError, match="2 media placeholder run"):
        merge_image_features(ids, embeds, _features((1, 3)), MEDIA_ID, PAD_ID)


def test_generate_with_images_prefill_only_cached_equals_uncached_and_batch_equals_single(model):
    patch = model.config.vision_config.patch_size
    gen = torch.Generator().manual_seed(3)
    pv_a, pv_b = torch.randn(24, 3, patch, patch, generator=gen), torch.randn(4, 3, patch, patch, generator=gen)
    ga, gb = torch.tensor([[1, 4, 6]]), torch.tensor([[1, 2, 2]])
    ids = torch.tensor([[5, MEDIA_ID, 7, 8], [PAD_ID, 9, MEDIA_ID, 10]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=PAD_ID)
    batch = model.generate(ids, attention_mask=mask, pixel_values=torch.cat([pv_a, pv_b]),
                           grid_thws=torch.cat([ga, gb]), **kw)
    uncached = model.generate(ids, attention_mask=mask, pixel_values=torch.cat([pv_a, pv_b]),
                              grid_thws=torch.cat([ga, gb]), use_cache=False, **kw)
    assert torch.equal(batch, uncached)
    single_b = model.generate(ids[1:, 1:], pixel_values=pv_b, grid_thws=gb, **kw)
    assert torch.equal(batch[1, 1:], single_b[0])
    # the image changes the continuation's logits (the splice is live)
    with torch.no_grad():
        one = model(input_ids=ids[1:, 1:], pixel_values=pv_b, grid_thws=gb).logits[0, -1]
        other = model(input_ids=ids[1:, 1:], pixel_values=-pv_b, grid_thws=gb).logits[0, -1]
    assert not torch.allclose(one, other)


def test_images_are_refused_where_they_cannot_be_spliced(model):
    patch = model.config.vision_config.patch_size
    with pytest.raises(ValueError, match="1 media placeholder run"):
        model(input_ids=torch.tensor([[5, MEDIA_ID]]), pixel_values=torch.randn(8, 3, patch, patch),
              grid_thws=torch.tensor([[1, 2, 2], [1, 2, 2]]))
    text_only = KimiK3ForConditionalGeneration(model.config, vision=False)
    assert text_only.vision_tower is None
    with pytest.raises(ValueError, match="no vision tower"):
        text_only(input_ids=torch.tensor([[5, MEDIA_ID]]), pixel_values=torch.randn(4, 3, patch, patch),
                  grid_thws=torch.tensor([[1, 2, 2]]))


# ---------------------------------------------------------------------------------------------------------------
# Release-layout checkpoint

def test_release_layout_checkpoint_loads_the_tower_bf16_and_without_vision_tensors_loads_text_only(tmp_path):
    fx = testing.write_release_checkpoint(tmp_path / "rel", num_layers=2, num_experts=2, seed=1)
    model = KimiK3ForConditionalGeneration.from_pretrained(fx.path, dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    for name, value in fx.dense.items():
        if name.startswith(("vision_tower.", "mm_projector.")):
            assert params[name].dtype == torch.bfloat16 and torch.equal(params[name], value), name
    patch = model.config.vision_config.patch_size
    with torch.no_grad():
        feats = model.get_image_features(torch.randn(16, 3, patch, patch), torch.tensor([[1, 4, 4]]))
    assert feats[0].dtype == torch.bfloat16 and bool(torch.isfinite(feats[0]).all())
    no_vision = testing.write_release_checkpoint(tmp_path / "text", num_layers=2, num_experts=2, vision=False)
    text_model = KimiK3ForConditionalGeneration.from_pretrained(no_vision.path)
    assert text_model.vision_tower is None and text_model.mm_projector is None


# ---------------------------------------------------------------------------------------------------------------
# Processor: AutoProcessor from a folder, the chat template with images, and its inputs through generate()

IMAGE_PROMPT = "<|media_begin|>image {w}x{h}<|media_content|><|media_pad|><|media_end|>"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from kimik3.tiny import write_tiny_folder

    directory = tmp_path_factory.mktemp("tiny")
    write_tiny_folder(directory, num_hidden_layers=2)
    return directory


def _load_processor_without_the_package(directory):
    """AutoProcessor with the installed package hidden: every module must come from the folder's flat files."""
    from transformers import AutoProcessor

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "kimik3", None)
        return AutoProcessor.from_pretrained(directory, trust_remote_code=True)


@pytest.fixture(scope="module")
def processor(tiny_folder):
    return _load_processor_without_the_package(tiny_folder)


@pytest.fixture(scope="module")
def vl_model(processor):
    """A tiny composite model on the tiny folder's vocabulary (512 ranks + 256 specials) and the processor's
    14-pixel patches."""
    from kimik3.tiny import TINY_NUM_RANKS
    from kimik3.tokenizer_files import special_token_ids

    ids = special_token_ids(TINY_NUM_RANKS)
    raw = testing.tiny_release_config(num_layers=2, num_experts=4, vision_overrides={"patch_size": 14},
                                      config_overrides={"vocab_size": TINY_NUM_RANKS + 256, **ids})
    raw.update(ids, media_placeholder_token_id=processor.tokenizer.convert_tokens_to_ids("<|media_pad|>"))
    torch.manual_seed(1)
    return KimiK3ForConditionalGeneration(KimiK3Config(**raw)).eval()


def _image(width, height, seed):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _conversation(text, *images):
    return [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                         {"type": "text", "text": text}]}]


def _by_hand(processor, conversations, images):
    """The release's prompt form written out: the template's text with each placeholder replaced by the image prompt
    (one `<|media_pad|>`, the model expands it), left-padded ids, and the image processor's pixels."""
    tokenizer = processor.tokenizer
    rows = []
    pending = iter(images)
    for conversation in conversations:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        parts = text.split("<|kimi_image_placeholder|>")
        prompts = [IMAGE_PROMPT.format(w=im.width, h=im.height) for im in (next(pending) for _ in parts[1:])]
        text = parts[0] + "".join(p + rest for p, rest in zip(prompts, parts[1:]))
        rows.append(tokenizer(text)["input_ids"])
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    pixels = processor.image_processor.preprocess(images)
    return ids, mask, pixels["pixel_values"], pixels["grid_thws"]


def test_auto_processor_loads_from_the_tiny_folder_and_from_a_saved_processor_folder(processor, tiny_folder,
                                                                                      tmp_path):
    for part in (processor, processor.image_processor, processor.tokenizer):
        assert type(part).__module__.startswith("transformers_modules."), type(part)
    assert type(processor).__name__ == "KimiK3Processor"
    assert type(processor.image_processor).__name__ == "KimiK3ImageProcessor"
    # save_pretrained from the folder-loaded processor (its code lives in the modules cache), with a setting that
    # differs from the default, must come back from the new folder
    processor.image_processor.media_proc_cfg["patch_limit_on_one_side"] = 4
    try:
        processor.save_pretrained(tmp_path / "proc")
    finally:
        processor.image_processor.media_proc_cfg["patch_limit_on_one_side"] = 512
    reloaded = _load_processor_without_the_package(tmp_path / "proc")
    assert type(reloaded.image_processor).__module__.startswith("transformers_modules.")
    assert reloaded.image_processor.media_proc_cfg["patch_limit_on_one_side"] == 4
    out = reloaded(text="<|kimi_image_placeholder|>hi", images=[_image(200, 60, 0)])
    assert out["grid_thws"].tolist() == [[1, 2, 4]]  # 200 x 60 scaled to 4 patches a side: 56 x 16 -> 56 x 28
    assert int((out["input_ids"] == processor.tokenizer.convert_tokens_to_ids("<|media_pad|>")).sum()) == 2


def test_chat_template_with_images_expands_the_placeholders_and_generates_as_the_inputs_built_by_hand(processor,
                                                                                                      vl_model):
    images = [_image(60, 40, 1), _image(30, 90, 2)]
    conversation = _conversation("What differs?", *images)
    inputs = processor.apply_chat_template(conversation, tokenize=True, return_dict=True, add_generation_prompt=True)
    media = processor.tokenizer.convert_tokens_to_ids("<|media_pad|>")
    # 60x40 -> 84x56 padded: grid 4x6, 2x3 = 6 rows; 30x90 -> 56x112: grid 8x4, 4x2 = 8 rows
    assert inputs["grid_thws"].tolist() == [[1, 4, 6], [1, 8, 4]]
    assert inputs["pixel_values"].shape == (24 + 32, 3, 14, 14)
    runs = [(start, length) for _, start, length in _placeholder_runs(inputs["input_ids"], media)]
    assert [length for _, length in runs] == [6, 8]
    ids, mask, pixels, grids = _by_hand(processor, [conversation], images)
    # collapsing each run to one `<|media_pad|>` gives the release's prompt exactly
    collapsed = [t for i, t in enumerate(inputs["input_ids"][0].tolist())
                 if t != media or i in {start for start, _ in runs}]
    assert collapsed == ids[0].tolist()
    assert torch.equal(inputs["pixel_values"], pixels) and torch.equal(inputs["grid_thws"], grids)
    kw = dict(max_new_tokens=4, do_sample=False)
    from_processor = vl_model.generate(**inputs, **kw)
    by_hand = vl_model.generate(ids, attention_mask=mask, pixel_values=pixels, grid_thws=grids, **kw)
    assert torch.equal(from_processor[:, -4:], by_hand[:, -4:])
    with torch.no_grad():
        a = vl_model(**inputs).logits[0, -1]
        b = vl_model(input_ids=ids, pixel_values=pixels, grid_thws=grids).logits[0, -1]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def batch(processor):
    images = [_image(60, 40, 3), _image(40, 40, 4), _image(70, 30, 5)]
    conversations = [_conversation("Describe it in a word.", images[0]),
                     _conversation("Which is brighter, the first or the second?", images[1], images[2])]
    inputs = processor.apply_chat_template(conversations, tokenize=True, return_dict=True,
                                           add_generation_prompt=True, padding=True, padding_side="left")
    return conversations, images, inputs


def test_batched_images_and_text_left_padded_generate_as_each_alone(processor, vl_model, batch):
    conversations, images, inputs = batch
    pad = processor.tokenizer.pad_token_id
    lengths = inputs["attention_mask"].sum(dim=1).tolist()
    short = lengths.index(min(lengths))
    width = inputs["input_ids"].shape[1]
    assert lengths[1 - short] == width and min(lengths) < width  # one row padded, on the left
    assert inputs["input_ids"][short, :width - min(lengths)].eq(pad).all()
    assert inputs["attention_mask"][short, :width - min(lengths)].eq(0).all()
    assert inputs["grid_thws"].shape == (3, 3)
    kw = dict(max_new_tokens=4, do_sample=False)
    together = vl_model.generate(**inputs, **kw)
    start = 0
    for row, conversation in enumerate(conversations):
        alone = processor.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                              add_generation_prompt=True)
        assert torch.equal(alone["pixel_values"], inputs["pixel_values"][start:start + len(alone["pixel_values"])])
        start += len(alone["pixel_values"])
        assert torch.equal(together[row, -4:], vl_model.generate(**alone, **kw)[0, -4:])


def test_static_cache_with_images_equals_dynamic_and_holds_the_merged_prompt(processor, vl_model, batch):
    conversations, images, inputs = batch
    ids, mask, pixels, grids = _by_hand(processor, conversations, images)  # one `<|media_pad|>` each: model expands
    kw = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    for batch_inputs in (dict(inputs), dict(input_ids=ids, attention_mask=mask, pixel_values=pixels,
                                            grid_thws=grids)):
        dynamic = vl_model.generate(**batch_inputs, **kw)
        static = vl_model.generate(**batch_inputs, cache_implementation="static", **kw)
        assert torch.equal(static.sequences, dynamic.sequences)
        cache = cache_of(static)
        assert cache.is_static
        # sized to the merged prompt: the pre-expanded batch needs no more than its length, the other its expansion
        assert cache.max_cache_len == inputs["input_ids"].shape[1] + 5 - 1


def test_processor_refuses_video_and_mismatched_images(processor):
    with pytest.raises(ValueError, match="images only"):
        processor(text="<|kimi_image_placeholder|>", videos=[np.zeros((2, 28, 28, 3), dtype=np.uint8)])
    with pytest.raises(ValueError, match="2 <|kimi_image_placeholder|> but 1 image"):
        processor(text="<|kimi_image_placeholder|><|kimi_image_placeholder|>", images=[_image(28, 28, 0)])
    out = processor(text="<|kimi_image_placeholder|>", images=[_image(28, 28, 0)], expand_media_pad=False)
    assert processor.decode(out["input_ids"][0]).count("<|media_pad|>") == 1


def test_the_cards_image_example_runs(processor, vl_model, tiny_folder, tmp_path, monkeypatch):
    """The Images section of the model card, run as written (with a short generation) on a folder holding our
    processor code and the tiny composite model."""
    from kimik3.hub_card import IMAGES_SECTION

    code = IMAGES_SECTION.split("```python\n")[1].split("```")[0].replace("max_new_tokens=2048", "max_new_tokens=3")
    _image(50, 30, 6).save(tmp_path / "photo.jpg")
    monkeypatch.chdir(tmp_path)
    scope = {"repo": str(tiny_folder), "model": vl_model}
    with monkeypatch.context() as hidden:  # the card's processor comes from the folder's files alone
        hidden.setitem(sys.modules, "kimik3", None)
        exec(code, scope)  # noqa: S102 - the card's own text
    assert type(scope["processor"]).__name__ == "KimiK3Processor"
    assert type(scope["processor"]).__module__.startswith("transformers_modules.")
    inputs, out = scope["inputs"], scope["out"]
    assert inputs["grid_thws"].tolist() == [[1, 4, 4]] and out.shape[1] == inputs["input_ids"].shape[1] + 3


# ---------------------------------------------------------------------------------------------------------------
# A converted release folder: our processor_config.json from the release's preprocessor_config.json


@pytest.fixture(scope="module")
def converted_release(tmp_path_factory):
    """A release-layout checkpoint (with the fixture's working tokenizer), converted."""
    import kimik3.convert as kc

    root = tmp_path_factory.mktemp("release_vision")
    fx = testing.write_release_checkpoint(root / "rel", num_layers=2, num_experts=2, return_dense=False)
    kc.convert(fx.path, root / "out", progress=False)
    return fx.path, root / "out"


def test_a_converted_release_loads_our_processor_with_the_releases_image_settings(converted_release, tmp_path):
    release, converted = converted_release
    processor = _load_processor_without_the_package(converted)
    for part in (processor, processor.image_processor, processor.tokenizer):
        assert type(part).__module__.startswith("transformers_modules."), type(part)
    assert type(processor).__name__ == "KimiK3Processor"
    assert type(processor.image_processor).__name__ == "KimiK3ImageProcessor"
    release_cfg = json.loads((release / "preprocessor_config.json").read_text())["media_proc_cfg"]
    settings = processor.image_processor.media_proc_cfg
    assert settings == {key: release_cfg[key] for key in settings}
    assert settings["patch_size"] == 4  # the tiny tower's, not the default 14
    # 20 x 12 with 4-pixel patches and a 2x2 merge: padded to 24 x 16, 4 x 6 patches, 2 x 3 = 6 rows
    out = processor(text="<|kimi_image_placeholder|>hi", images=[_image(20, 12, 0)])
    assert out["grid_thws"].tolist() == [[1, 4, 6]] and out["pixel_values"].shape == (24, 3, 4, 4)
    assert int((out["input_ids"] == processor.tokenizer.convert_tokens_to_ids("<|media_pad|>")).sum()) == 6
    # the converter's processor_config.json is what the processor itself saves
    processor.save_pretrained(tmp_path / "saved")
    assert (json.loads((tmp_path / "saved" / "processor_config.json").read_text())
            == json.loads((converted / "processor_config.json").read_text()))
    # the release's transparent-background fill is applied: a fully transparent image shows the chessboard
    assert settings["transparent_bg_config"] == RELEASE_BG and settings["transparent_bg_fill_stage"] == "after_resize"
    clear = Image.fromarray(np.zeros((12, 20, 4), dtype=np.uint8), mode="RGBA")
    board = _processed_bytes(processor.image_processor.preprocess([clear]), 4, 6, 4)[:12, :20]
    np.testing.assert_array_equal(board, [[[_board(x, y)] * 3 for x in range(20)] for y in range(12)])
    notes = json.loads((converted / "kimik3_conversion.json").read_text())["notes"]
    assert not any("transparent_bg" in note for note in notes)


@pytest.mark.parametrize("key, value", [("fixed_output_tokens", 64), ("image_std", [0.5, 0.0, 0.5]),
                                        ("merge_kernel_size", [2, 1]), ("patch_size", "14"), ("patch_size", 14),
                                        ("transparent_bg_config", {**RELEASE_BG, "chessboard_square_size": -8}),
                                        ("transparent_bg_fill_stage", "during_resize")],
                         ids=["fixed-tokens", "zero-std", "non-square-merge", "text-patch", "not-the-towers-patch",
                              "bad-fill", "bad-fill-stage"])
def test_conversion_refuses_image_settings_our_processor_does_not_support(converted_release, tmp_path, key, value):
    import kimik3.convert as kc

    release, _ = converted_release
    path = release / "preprocessor_config.json"
    original = path.read_bytes()
    values = json.loads(original)
    values["media_proc_cfg"][key] = value
    path.write_text(json.dumps(values))
    try:
        with pytest.raises(kc.ConversionError, match=rf"preprocessor_config.json: media_proc_cfg.{key} = "):
            kc.convert(release, tmp_path / "out", progress=False)
    finally:
        path.write_bytes(original)
    assert not (tmp_path / "out").exists()  # refused before anything is written
