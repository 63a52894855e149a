"""Context parallelism (KDA by state composition, MLA by latent all-gather) and FSDP2 training on 2 gloo processes
(tests/context_parallel_worker.py in the suite's one two-rank launch, conftest.py), each against the single-process
model in f32."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from k3_test_utils import cache_of
from kimik3.modeling.cache_kimi_k3 import KimiK3StaticCache
from kimik3.modeling.context_parallel_kimi_k3 import kda_exchange_bytes, mla_exchange_bytes_per_token
from kimik3.modeling.ops_kimi_k3 import chunk_kda, kda_segment_transition, l2norm
from kimik3.tiny import build_tiny_model
from kimik3.training import QuantileBalancer


TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

import context_parallel_worker as worker  # noqa: E402



@pytest.fixture(scope="module")
def model():
    return build_tiny_model(seed=worker.SEED)


@pytest.fixture(scope="module")
def runs(two_rank_runs):
    """The 2 gloo ranks' results (the shared two-rank launch, conftest.py): [(report, tensors)] per rank."""
    out_dir = two_rank_runs["context_parallel"]
    return [(json.loads((out_dir / f"rank{r}.json").read_text()), load_file(str(out_dir / f"rank{r}.safetensors")))
            for r in range(2)]


# ------------------------------------------------------------------------------------------------------------------
# The algebra, on one process


def test_segment_transition_is_the_exact_affine_map_of_the_chunk_form():
    torch.manual_seed(0)
    batch, length, heads, k_dim, v_dim, chunk = 2, 37, 3, 8, 6, 16
    q, k = torch.randn(batch, length, heads, k_dim), torch.randn(batch, length, heads, k_dim)
    v = torch.randn(batch, length, heads, v_dim)
    g = -0.05 * torch.sigmoid(torch.randn(batch, length, heads, k_dim))  # slow decay: the map stays far from 0
    beta = torch.rand(batch, length, heads)
    state = torch.randn(batch, heads, k_dim, v_dim)
    kwargs = {"output_final_state": True, "use_qk_l2norm_in_kernel": True, "chunk_size": chunk}
    out, final = chunk_kda(q, k, v, g, beta, initial_state=state, **kwargs)
    zero_out, zero_final = chunk_kda(q, k, v, g, beta, **kwargs)
    transition = kda_segment_transition(k, g, beta, use_qk_l2norm_in_kernel=True, chunk_size=chunk)
    assert transition.shape == (batch, heads, k_dim, k_dim) and transition.abs().max() > 0.05
    torch.testing.assert_close(transition @ state + zero_final, final, rtol=0, atol=1e-6)
    # the correction pass: outputs are affine in the incoming state too
    correction, _ = chunk_kda(q, k, torch.zeros_like(v), g, beta, initial_state=state, **kwargs)
    torch.testing.assert_close(zero_out + correction, out, rtol=0, atol=1e-6)
    # and the map is the ordered product of the per-token maps (I - beta k k^T) Diag(alpha)
    k_unit = l2norm(k)
    product = torch.eye(k_dim).expand(batch, heads, k_dim, k_dim)
    for t in range(length):
        outer = k_unit[:, t, :, :, None] * k_unit[:, t, :, None, :]
        step = (torch.eye(k_dim) - beta[:, t, :, None, None] * outer) * g[:, t].exp()[..., None, :]
        product = step @ product
    torch.testing.assert_close(transition, product, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------------------------
# Context-parallel prefill and training against one process


@pytest.mark.parametrize("length", worker.PREFILL_LENGTHS)
def test_context_parallel_prefill_matches_one_process(runs, model, length):
    input_ids = worker.token_ids(2, length, length, model.config.vocab_size)
    with torch.no_grad():
        output = model(input_ids=input_ids, use_cache=True)
    reference = worker.cache_tensors(cache_of(output), "cache")
    start = 0
    for rank, (report, tensors) in enumerate(runs):
        info = report[f"prefill{length}"]
        end = start + info["lengths"][rank]
        torch.testing.assert_close(tensors[f"prefill{length}.logits"], output.logits[:, start:end], rtol=1e-5,
                                   atol=1e-5)
        # every rank holds the whole sequence's cache: all latents, the last KDA state and conv windows
        assert info["seen_tokens"] == length
        for name, want in reference.items():
            torch.testing.assert_close(tensors[f"prefill{length}.{name}"], want, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
        start = end


def test_second_segment_needs_the_composed_state(runs, model):
    """The check above fails without the composition: the second segment alone (zero state, no conv halo) gives
    other logits."""
    length = worker.PREFILL_LENGTHS[0]
    report, tensors = runs[1]
    input_ids = worker.token_ids(2, length, length, model.config.vocab_size)
    with torch.no_grad():
        alone = model(input_ids=input_ids[:, report[f"prefill{length}"]["lengths"][0]:]).logits
    assert (alone - tensors[f"prefill{length}.logits"]).abs().max() > 1e-3


def test_exchanged_bytes_per_kda_layer_do_not_depend_on_the_length(runs, model):
    config = model.config
    kda_layers = [i for i, t in enumerate(config.layer_types) if t == "linear_attention"]
    mla_layers = [i for i, t in enumerate(config.layer_types) if t == "full_attention"]
    per_kda_layer = kda_exchange_bytes(config, batch_size=2, activation_bytes=4)
    # f32 transition + zero-start state [B, H, K, K + V], and 3 x (K - 1) pre-conv rows of the halo
    heads, dim = config.linear_num_heads, config.linear_head_dim
    halo_rows = config.linear_conv_kernel_size - 1
    assert per_kda_layer == 2 * heads * dim * 2 * dim * 4 + 3 * 2 * halo_rows * heads * dim * 4
    for report, _ in runs:
        for length in worker.PREFILL_LENGTHS:
            info = report[f"prefill{length}"]
            sent = {int(k): v for k, v in info["exchanged_bytes"].items()}
            assert {sent[i] for i in kda_layers} == {per_kda_layer}, length
            # MLA: latents only (kv_lora_rank + rope values per token of the longest segment), not expanded K/V
            for i in mla_layers:
                assert sent[i] == 2 * max(info["lengths"]) * mla_exchange_bytes_per_token(config, 4)
    assert mla_exchange_bytes_per_token(config, 2) == 2 * (config.kv_lora_rank + config.qk_rope_head_dim)


def test_context_parallel_training_gradients_match_one_process(runs, model):
    model = build_tiny_model(seed=worker.SEED).train()
    input_ids = worker.token_ids(2, worker.TRAIN_LENGTH, 1, model.config.vocab_size)
    labels = worker.shifted_labels(input_ids)
    logits = model(input_ids=input_ids, use_cache=False).logits
    worker.next_token_loss(logits, labels, int((labels != -100).sum())).backward()
    grads = {f"grad.{n}": p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert len(grads) > 50
    for rank, (_, tensors) in enumerate(runs):
        assert set(grads) == {k for k in tensors if k.startswith("grad.")}
        for name, want in grads.items():
            torch.testing.assert_close(tensors[name], want, rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


# ------------------------------------------------------------------------------------------------------------------
# FSDP2


def test_fsdp2_training_loss_curve_matches_one_process(runs):
    """Same global batch: 2 ranks of 2 rows (FSDP2, gradient checkpointing, Quantile Balancing with its histogram
    all-reduce) against one process of 4 rows."""
    model = build_tiny_model(seed=worker.SEED).train()
    balancer = QuantileBalancer(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=worker.FSDP_LR)
    losses = []
    for step in range(worker.FSDP_STEPS):
        batch = worker.token_ids(worker.FSDP_BATCH, worker.FSDP_LENGTH, 100 + step, model.config.vocab_size)
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        balancer.step()
        losses.append(float(loss.detach()))
    biases = {f"fsdp.{n}": b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    assert any(b.abs().max() > 0 for b in biases.values())  # balancing moved the biases
    for report, tensors in runs:
        assert report["fsdp_losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
        for name, want in biases.items():
            torch.testing.assert_close(tensors[name], want, rtol=1e-5, atol=1e-6)


def test_fsdp2_groups_keep_the_f32_islands_of_a_bf16_model(runs):
    for report, _ in runs:
        info = report["bf16_fsdp"]
        assert info["loss_finite"] and info["grads_finite"]
        suffixes = {name.split("self_attn.")[-1] for name in info["f32_params"]}
        assert suffixes == {"A_log", "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight",
                            "o_norm.weight"}


def test_trainer_fsdp_args_give_accelerate_an_fsdp2_plugin_per_decoder_layer(tmp_path):
    from transformers import TrainingArguments

    from kimik3.training.fsdp import trainer_fsdp_args

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **trainer_fsdp_args())
    plugin = args.fsdp_plugin_args
    assert (plugin["fsdp_version"], plugin["transformer_cls_names_to_wrap"]) == (2, "KimiK3DecoderLayer")
    assert plugin["activation_checkpointing"] and plugin["reshard_after_forward"]


def test_context_parallel_refuses_what_it_does_not_run(model):
    from kimik3.modeling.context_parallel_kimi_k3 import ContextParallel

    cp = ContextParallel(lengths=(4, 4), rank=1)
    with pytest.raises(ValueError, match="expects its segment of 4 tokens"):
        cp.check_inputs(5, None, None)
    with pytest.raises(ValueError, match="unpadded"):
        cp.check_inputs(4, torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]]), None)
    cache = KimiK3StaticCache(model.config, max_cache_len=16)
    with pytest.raises(ValueError, match="fresh prefill"):
        cp.check_inputs(4, None, cache)
    assert (cp.start, cp.end, cp.total_length) == (4, 8, 8)
    with pytest.raises(ValueError, match="full sequence of 8"):
        cp.shard(torch.zeros(1, 7))
