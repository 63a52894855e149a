"""Vision: the MoonViT-3d tower and projector against a per-patch reference written out here, the image processor's
release rules, the placeholder splice, images through generate(), and loading the tower from a release-layout
checkpoint."""

import copy
import math

import numpy as np
import pytest
import torch
from PIL import Image

from convert import testing
from kimik3.modeling.configuration_kimi_k3 import KimiK3Config
from kimik3.modeling.image_processing_kimi_k3 import KimiK3ImageProcessor
from kimik3.modeling.modeling_kimi_k3 import KimiK3ForConditionalGeneration, merge_image_features

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
