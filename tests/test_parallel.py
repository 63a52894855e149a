"""Spreading the tiny model over devices on CPU: a device_map with CPU and disk offload, and tensor / expert parallel
plans on 2 gloo processes (tests/parallel_worker.py under torchrun), each against the single-process model."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM



TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS.parent / "benchmarks"))

from parallel_worker import INPUT_IDS, MODES, NEW_TOKENS  # noqa: E402



@pytest.fixture(scope="module")
def tiny_dir(two_rank_runs):
    return two_rank_runs["tiny_dir"]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """Logits and greedy tokens of the single-process model (f32)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, trust_remote_code=True, dtype=torch.float32).eval()
    input_ids = torch.tensor(INPUT_IDS)
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
        generated = model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    return model.config, logits, generated


@pytest.fixture(scope="module")
def parallel_runs(two_rank_runs):
    """The 2 gloo ranks' results of every mode in turn (the shared two-rank launch, conftest.py): {mode: [per rank]}."""
    out_dir = two_rank_runs["parallel"]
    runs = {}
    for mode in MODES:
        runs[mode] = [
            {**json.loads((out_dir / f"{mode}-rank{rank}.json").read_text()),
             **load_file(str(out_dir / f"{mode}-rank{rank}.safetensors"))}
            for rank in range(2)
        ]
    return runs


def expected_shapes(config, mode: str) -> dict[str, list[int]]:
    """Local shapes on each of 2 ranks: heads halved under TP, whole experts halved under EP."""
    tp, ep = mode in ("tp", "tp_ep"), mode in ("ep", "tp_ep")
    heads, head_dim, hidden = config.linear_num_heads, config.linear_head_dim, config.hidden_size
    mla_heads, qk, nope_v = config.num_attention_heads, config.qk_head_dim, config.qk_nope_head_dim + config.v_head_dim
    experts, inter, latent = config.num_experts, config.moe_intermediate_size, config.latent_size
    shared = inter * config.num_shared_experts
    h = heads // 2 if tp else heads  # local KDA heads
    m = mla_heads // 2 if tp else mla_heads  # local MLA heads
    e = experts // 2 if ep else experts
    i = inter // 2 if (tp and not ep) else inter  # experts sharded by width under TP alone
    s = shared // 2 if tp else shared
    return {
        "kda.self_attn.q_proj.weight": [h * head_dim, hidden],
        "kda.self_attn.A_log": [h],
        "kda.self_attn.dt_bias": [h * head_dim],
        "kda.self_attn.q_conv1d.weight": [h * head_dim, 1, config.linear_conv_kernel_size],
        "kda.self_attn.b_proj.weight": [h, hidden],
        "kda.self_attn.g_proj.weight": [h * head_dim, hidden],
        "kda.self_attn.f_b_proj.weight": [h * head_dim, head_dim],
        "kda.self_attn.o_norm.weight": [head_dim],
        "kda.self_attn.o_proj.weight": [hidden, h * head_dim],
        "kda.recurrent_state": [len(INPUT_IDS), h, head_dim, head_dim],
        "mla.self_attn.q_b_proj.weight": [m * qk, config.q_lora_rank],
        "mla.self_attn.kv_b_proj.weight": [m * nope_v, config.kv_lora_rank],
        "mla.self_attn.kv_a_proj_with_mqa.weight": [config.mla_cache_dim, hidden],
        "mla.self_attn.g_proj.weight": [m * config.v_head_dim, hidden],
        "mla.self_attn.o_proj.weight": [hidden, m * config.v_head_dim],
        "moe.mlp.gate.weight": [experts, hidden],
        "moe.mlp.experts.gate_up_proj": [e, 2 * i, latent],
        "moe.mlp.experts.down_proj": [e, latent, i],
        "moe.mlp.routed_expert_down_proj.weight": [latent, hidden],
        "moe.mlp.shared_experts.gate_proj.weight": [s, hidden],
        "moe.mlp.shared_experts.down_proj.weight": [hidden, s],
        "moe.mlp_res_proj.weight": [1, hidden],
    }


@pytest.mark.parametrize("mode", MODES)
def test_parallel_plan_shards_and_matches_one_process(parallel_runs, reference, mode):
    config, logits, generated = reference
    want = expected_shapes(config, mode)
    for rank, run in enumerate(parallel_runs[mode]):
        assert run["shapes"] == want, f"rank {rank}"
        # f32 on CPU: only the order of the all-reduced partial sums differs from one process
        torch.testing.assert_close(run["logits"], logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(run["generated"], generated)


def test_device_map_with_cpu_and_disk_offload_matches_one_device(tiny_dir, reference, tmp_path):
    """Layers alternate between CPU and disk offload (weights on the meta device outside their module's forward),
    the AttnRes output mix's weights on disk; dynamic and static caches."""
    config, logits, generated = reference
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "lm_head": "cpu",
                  "model.output_attn_res_norm": "disk", "model.output_attn_res_proj": "disk"}
    device_map |= {f"model.layers.{i}": ("disk" if i % 2 else "cpu") for i in range(config.num_hidden_layers)}
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, trust_remote_code=True, dtype=torch.float32,
                                                 device_map=device_map, offload_folder=tmp_path).eval()
    assert model.model.layers[1].self_attn.q_conv1d.weight.device.type == "meta"  # really offloaded
    input_ids = torch.tensor(INPUT_IDS)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=input_ids).logits, logits, rtol=0, atol=0)
        assert torch.equal(model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False), generated)
        static = model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static")
        assert torch.equal(static, generated)



def test_bench_parallel_arguments_and_cpu_dry_run(tmp_path):
    import bench_parallel

    with pytest.raises(SystemExit):
        bench_parallel.parse_args(["--modes", "single,ring"])
    args = bench_parallel.parse_args(["--dry-run", "--batches", "1,8"])
    assert (args.modes, args.batches, args.prefill_tokens) == (list(bench_parallel.MODES), [1, 8], 16)
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    out = tmp_path / "bench.json"
    results = bench_parallel.main(["--dry-run", "--modes", "single", "--batches", "2", "--out", str(out)])
    assert json.loads(out.read_text())["single"]["decode_b2"]["ms_per_step"] == results["single"]["decode_b2"][
        "ms_per_step"] > 0
    assert results["single"]["prefill"]["tokens_per_s"] > 0 and "error" not in results["single"]
