"""Helper for tests/test_parallel.py, run by torchrun on 2 CPU processes (gloo): loads a model folder under each
parallel plan asked for, and writes per rank what the test checks (the local shard shapes, the KDA recurrent state's
shape, the logits of one forward and greedy tokens) to OUT/<mode>-rank<r>.json / .safetensors.

    torchrun --standalone --nproc-per-node 2 tests/parallel_worker.py MODEL_DIR OUT_DIR tp ep tp_ep
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM


# (layer, dotted name inside the layer) of the parameters whose local shapes show the plan
SHARD_PROBES = {
    "kda": ("self_attn.q_proj.weight", "self_attn.A_log", "self_attn.dt_bias", "self_attn.q_conv1d.weight",
            "self_attn.b_proj.weight", "self_attn.g_proj.weight", "self_attn.f_b_proj.weight",
            "self_attn.o_norm.weight", "self_attn.o_proj.weight"),
    "mla": ("self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
            "self_attn.g_proj.weight", "self_attn.o_proj.weight"),
    "moe": ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj",
            "mlp.routed_expert_down_proj.weight", "mlp.shared_experts.gate_proj.weight",
            "mlp.shared_experts.down_proj.weight", "mlp_res_proj.weight"),
}
INPUT_IDS = [[5, 17, 99, 3, 42, 7, 64, 11], [9, 1, 120, 33, 8, 77, 2, 50]]
NEW_TOKENS = 4
ON_CUDA = os.environ.get("KIMIK3_PARALLEL_DEVICE") == "cuda"
# transformers >= 5.21 combines TP with EP (ep_size == tp_size); 5.17-5.20 run EP alone (enable_expert_parallel)
HAS_EP_DISPATCH = importlib.util.find_spec("transformers.distributed.expert_parallel") is not None
MODES = ("tp", "tp_ep") if HAS_EP_DISPATCH else ("tp", "ep")
# On 4 ranks, with transformers >= 5.21, also `tp2_ep`: TP inside each pair of ranks and EP over all of them (the
# multi-node layout, TP inside a node and EP across nodes), the dense modules' remaining factor of 2 as FSDP. A grid of
# TP 2 x EP 2 with the experts split both ways cannot be expressed: transformers gives a module with an EP rule no TP
# rule (its expert mesh is pp x dp_replicate x efsdp x ep, no expert-TP axis) and wants ep_size a multiple of tp_size,
# so EP groups always contain the TP groups. 5.17-5.20 have no ep_size: EP alone (enable_expert_parallel) or TP alone.
FOUR_RANK_MODES = (*MODES, "tp2_ep") if HAS_EP_DISPATCH else MODES


def distributed_kwargs(mode: str, world_size: int = 2) -> dict:
    """The from_pretrained options of `mode` on `world_size` ranks."""
    from transformers.distributed import DistributedConfig

    fields = getattr(DistributedConfig, "__dataclass_fields__", {})
    if mode == "tp":
        return {"tp_plan": "auto"}
    if mode == "ep" and "ep_size" in fields:  # transformers >= 5.21: experts only, attention replicated
        return {"distributed_config": DistributedConfig(tp_size=world_size, ep_size=world_size, tp_plan={})}
    if mode == "ep":
        return {"distributed_config": DistributedConfig(tp_size=world_size, enable_expert_parallel=True)}
    if mode == "tp_ep":
        return {"distributed_config": DistributedConfig(tp_size=world_size, ep_size=world_size)}
    if mode == "tp2_ep":
        return {"distributed_config": DistributedConfig(tp_size=2, ep_size=world_size, fsdp_size=world_size // 2)}
    raise ValueError(f"unknown mode {mode!r}")


def local_shape(tensor) -> list[int]:
    to_local = getattr(tensor, "to_local", None)
    return list((tensor if to_local is None else to_local()).shape)


def run(model_dir: str, out_dir: Path, mode: str, rank: int) -> None:
    # CPU (gloo): f32, tight tolerance; GPU (NCCL, tests/gpu): bf16 as deployed
    dtype = torch.bfloat16 if ON_CUDA else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True, dtype=dtype,
                                                 **distributed_kwargs(mode))
    model.eval()
    text_config = model.config.get_text_config()
    kda_layer = text_config.layer_types.index("linear_attention")
    mla_layer = text_config.layer_types.index("full_attention")
    moe_layer = text_config.mlp_layer_types.index("sparse")
    params = dict(model.named_parameters())
    shapes = {}
    for kind, layer in (("kda", kda_layer), ("mla", mla_layer), ("moe", moe_layer)):
        for name in SHARD_PROBES[kind]:
            shapes[f"{kind}.{name}"] = local_shape(params[f"model.layers.{layer}.{name}"])
    input_ids = torch.tensor(INPUT_IDS, device=f"cuda:{rank}" if ON_CUDA else "cpu")
    with torch.no_grad():
        output = model(input_ids=input_ids, use_cache=True)
        cache = output.cache if hasattr(output, "cache") else output.past_key_values
        shapes["kda.recurrent_state"] = list(cache.kda_state(kda_layer)[1].shape)
        generated = model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    (out_dir / f"{mode}-rank{rank}.json").write_text(json.dumps({"shapes": shapes}))
    save_file({"logits": output.logits.cpu().contiguous(), "generated": generated.cpu().contiguous()},
              str(out_dir / f"{mode}-rank{rank}.safetensors"))


def run_modes(model_dir: str, out_dir: Path, modes) -> None:
    """Every mode in turn, in an initialised process group."""
    for mode in modes:
        run(model_dir, Path(out_dir), mode, dist.get_rank())
        dist.barrier()


def main(argv: list[str]) -> None:
    model_dir, out_dir, *modes = argv
    dist.init_process_group("nccl" if ON_CUDA else "gloo")
    if ON_CUDA:
        torch.cuda.set_device(dist.get_rank())
    try:
        run_modes(model_dir, Path(out_dir), modes)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
