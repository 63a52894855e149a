"""Helper for tests/test_parallel.py: the routed experts kept packed (MXFP4 codes + E8M0 scales) under the
tensor- and expert-parallel plans, on the ranks of an initialised process group (gloo on CPU; the shared two-rank
launch of tests/two_rank_worker.py, or torchrun). Rank 0 writes the packed tiny model to OUT/model
(`write_packed_folder`); per mode every rank writes OUT/<mode>-rank<r>.json (the local shapes of
one MoE layer's packed tensors, the packed bytes this rank holds and their storage, and what its load read from
the files and its peak memory growth: `load_measured`) and .safetensors (the logits,
greedy tokens and, after one backward through the packed experts, the gradients of the input embeddings and of the
replicated projection that feeds the experts), OUT/saved-<mode> the folder the sharded model's save_pretrained
wrote, and `bad-<mode>` the load-time check of a bad scale byte on the rank holding it; `cut` records the refusal of
a degree that would cut an MXFP4 group; `adopted-<mode>` the load of a tiny release folder adopted with packed
experts (`kimik3 adopt --experts-format mxfp4`: the release layout on disk, per-expert w1/w2/w3 codes and scales that
the loader fuses) under the same plan, or its refusal.

    torchrun --standalone --nproc-per-node 2 tests/packed_parallel_worker.py DENSE_TINY_DIR OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from k3_test_utils import refresh_adoption_fingerprints
from load_reads import counting_reads, peak_rss_growth
from parallel_worker import INPUT_IDS, MODES, NEW_TOKENS, distributed_kwargs

# 4 MXFP4 groups of 32 along the intermediate width: whole groups on 2 and on 4 tensor-parallel ranks (the tiny
# model's 32 is one group, which the `cut` mode shows refused)
PACKED_INTERMEDIATE_SIZE = 128
PACKED_OUT = "packed"  # under the dense plans' output folder, in the shared launch
PACKED_SUFFIXES = ("gate_up_proj_packed", "gate_up_proj_scale", "down_proj_packed", "down_proj_scale")
GRADIENT_SEED = 0
ADOPTED = "release"  # the tiny release folder and its adopted folder, under the packed checks' output folder


def write_packed_folder(directory: Path) -> Path:
    """The tiny model at PACKED_INTERMEDIATE_SIZE with its experts packed (kimik3.tiny.packed_mxfp4_copy), saved."""
    from kimik3.tiny import build_tiny_model, packed_mxfp4_copy

    packed_mxfp4_copy(build_tiny_model(moe_intermediate_size=PACKED_INTERMEDIATE_SIZE)).save_pretrained(directory)
    return directory


def local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return tensor if to_local is None else to_local()


def logits_and_greedy(model) -> dict[str, torch.Tensor]:
    """The logits of one forward and the greedy tokens of INPUT_IDS (no grad)."""
    input_ids = torch.tensor(INPUT_IDS, device=model.get_input_embeddings().weight.device)
    with torch.no_grad():
        return {"logits": model(input_ids=input_ids).logits,
                "generated": model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False)}


def forward_and_backward(model) -> dict[str, torch.Tensor]:
    """Logits and greedy tokens (no grad); then one backward of a fixed random projection of the logits, from the
    input embeddings (so the vocabulary-parallel embedding is not differentiated) through every layer."""
    device = model.get_input_embeddings().weight.device
    results = logits_and_greedy(model)
    logits = results["logits"]
    with torch.no_grad():
        embeds = model.get_input_embeddings()(torch.tensor(INPUT_IDS, device=device))
    moe_layer = model.config.mlp_layer_types.index("sparse")
    feed = model.model.layers[moe_layer].mlp.routed_expert_down_proj.weight
    embeds = embeds.detach().requires_grad_(True)
    probe = torch.randn(logits.shape, generator=torch.Generator().manual_seed(GRADIENT_SEED)).to(device)
    loss = (model(inputs_embeds=embeds).logits.float() * probe).mean()  # gradients of order 1: f32 tolerances hold
    grad_embeds, grad_feed = torch.autograd.grad(loss, [embeds, feed])
    return {**results, "grad_embeds": grad_embeds, "grad_expert_feed": local(grad_feed)}


def packed_holdings(model) -> dict:
    """One MoE layer's packed local shapes, and over every layer the packed bytes this rank holds (numel) and the
    bytes of the storage behind them (a view into a full copy would show here)."""
    moe_layer = model.config.mlp_layer_types.index("sparse")
    experts = model.model.layers[moe_layer].mlp.experts
    shapes = {suffix: list(local(getattr(experts, suffix)).shape) for suffix in PACKED_SUFFIXES}
    tensors = [local(p) for n, p in model.named_parameters() if n.endswith(PACKED_SUFFIXES)]
    return {"shapes": shapes, "num_local_experts": experts.num_experts,
            "bytes": sum(t.numel() * t.element_size() for t in tensors),
            "storage_bytes": sum(t.untyped_storage().nbytes() for t in tensors),
            "requires_grad": any(p.requires_grad for n, p in model.named_parameters() if n.endswith(PACKED_SUFFIXES))}


# this process's measured loads: the first of a forked rank also pays for what it first touches of the parent's memory
# (copy-on-write) and for transformers' lazily imported loading code
_LOADED: list[str] = []


def load_measured(folder: str, **kwargs):
    """from_pretrained(folder, f32, remote code, **kwargs) and what the load cost this rank: {checkpoint tensor:
    bytes read from the files}, the peak resident growth, and the elements this rank holds of each tensor of the
    state dict (its local shard's), which the test compares with the one process's (load_reads.py)."""
    first = not _LOADED
    with counting_reads() as reads, peak_rss_growth() as peak:
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32, **kwargs)
    _LOADED.append(folder)
    state = {name: local(tensor) for name, tensor in model.state_dict().items()}
    return model.eval(), {"reads": reads, "rss_growth": peak["bytes"], "first_load": first,
                          "held_numel": {name: tensor.numel() for name, tensor in state.items()},
                          "held_bytes": sum(t.numel() * t.element_size() for t in state.values())}


def run(packed_dir: str, out_dir: Path, mode: str, rank: int, backward: bool = True, save: bool = False) -> None:
    """The packed folder under `mode` on this process group's ranks: holdings, what the load read, logits, greedy
    tokens, (with `backward`) the gradients and (with `save`) the sharded model's save_pretrained, on every rank, to
    OUT/saved-<mode>."""
    model, load = load_measured(packed_dir, **distributed_kwargs(mode, dist.get_world_size()))
    (out_dir / f"{mode}-rank{rank}.json").write_text(json.dumps({**packed_holdings(model), "load": load}))
    results = forward_and_backward(model) if backward else logits_and_greedy(model)
    results = {name: tensor.detach().cpu().contiguous() for name, tensor in results.items()}
    save_file(results, str(out_dir / f"{mode}-rank{rank}.safetensors"))
    if save:
        model.save_pretrained(out_dir / f"saved-{mode}")


def record_cut(dense_dir: str, out_dir: Path, rank: int) -> None:
    """The tiny model's experts (one group of 32 along the intermediate width) asked packed on 2 tensor-parallel
    ranks: refused when the plan is applied, before any weight is read."""
    try:
        AutoModelForCausalLM.from_pretrained(dense_dir, trust_remote_code=True, dtype=torch.float32,
                                             experts_format="mxfp4", **distributed_kwargs("tp"))
        error = None
    except ValueError as exc:
        error = str(exc)
    (out_dir / f"cut-rank{rank}.json").write_text(json.dumps({"error": error}))


# An E8M0 scale byte of 0xFF (inf) in the last up (w3) row of expert 5 of the first MoE layer: on rank 1 under TP
# (the second half of each of gate and up) and under EP (experts 4-7)
BAD_EXPERT, BAD_SCALE = 5, "gate_up_proj_scale"


def write_bad_scale_folder(packed_dir: Path, directory: Path) -> str:
    """A copy of the packed folder with the bad scale byte; returns the fused tensor's name."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file

    shutil.copytree(packed_dir, directory)
    weights = directory / "model.safetensors"
    with safe_open(str(weights), "pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(str(weights))
    name = next(n for n in tensors if n.endswith(f".experts.{BAD_SCALE}"))
    tensors[name][BAD_EXPERT, -1, 0] = 0xFF
    save_file(tensors, str(weights), metadata=metadata)
    return name


def record_refusal(folder: str, out_path: Path, mode: str) -> None:
    """A load of `folder` under `mode` on this rank: the error it raised (None: it loaded), as JSON at out_path."""
    try:
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32,
                                             **distributed_kwargs(mode))
        error = None
    except Exception as exc:  # KimiK3LoadError, from the folder's own copy of the code
        error = f"{type(exc).__name__}: {exc}"
    out_path.write_text(json.dumps({"error": error}))


def write_adopted_release(directory: Path) -> Path:
    """A tiny text-only release folder (kimik3.convert.testing) at PACKED_INTERMEDIATE_SIZE and its adopted folder
    with the experts kept packed; returns the adopted folder."""
    from kimik3.convert.adopt import adopt
    from kimik3.convert.testing import write_release_checkpoint

    release = write_release_checkpoint(directory / "release", seed=3, num_layers=2, num_experts=4, vision=False,
                                       config_overrides={"moe_intermediate_size": PACKED_INTERMEDIATE_SIZE},
                                       return_dense=False)
    adopt(release.path, directory / "adopted", experts_format="mxfp4")
    return directory / "adopted"


def adopted_results(model) -> tuple[dict, dict[str, torch.Tensor]]:
    """The composite model's text half: its packed holdings, and its logits and greedy tokens."""
    return packed_holdings(model.language_model), logits_and_greedy(model)


def record_adopted(adopted_dir: str, out_dir: Path, mode: str, rank: int) -> None:
    """The adopted release folder loaded under `mode`: its results, or the load's refusal."""
    try:
        model, load = load_measured(adopted_dir, **distributed_kwargs(mode))
    except Exception as exc:  # KimiK3LoadError, from the folder's own copy of the code
        (out_dir / f"adopted-{mode}-rank{rank}.json").write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return
    holdings, results = adopted_results(model)
    (out_dir / f"adopted-{mode}-rank{rank}.json").write_text(json.dumps({"error": None, **holdings, "load": load}))
    save_file({name: tensor.detach().cpu().contiguous() for name, tensor in results.items()},
              str(out_dir / f"adopted-{mode}-rank{rank}.safetensors"))
    # the sharded release-loaded model's save: every rank calls it, the release layout comes out whole
    model.save_pretrained(out_dir / f"adopted-saved-{mode}")


BAD_A_LOG = "bad_a_log"  # a tiny release (two KDA layers) adopted, then its A_logs damaged, under the output folder
# Layer 0's padding holds a non-zero value at an index only rank 1 reads under TP 2; layer 1's A_log is shorter than
# the heads (rank 1 reads nothing of it)
BAD_A_LOG_ENTRY = 100


def write_bad_a_log_release(directory: Path) -> Path:
    """The adopted folder of a tiny release whose A_logs are then damaged in the release's own shards (which the
    adopted folder links): returns the adopted folder."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from kimik3.convert.adopt import adopt
    from kimik3.convert.testing import write_release_checkpoint

    release = write_release_checkpoint(directory / "release", seed=4, num_layers=3, num_experts=4, vision=False,
                                       config_overrides={"moe_intermediate_size": PACKED_INTERMEDIATE_SIZE},
                                       return_dense=False)
    adopt(release.path, directory / "adopted", experts_format="mxfp4")
    weight_map = json.loads((release.path / "model.safetensors.index.json").read_text())["weight_map"]
    for layer in (0, 1):
        name = f"language_model.model.layers.{layer}.self_attn.A_log"
        shard = release.path / weight_map[name]
        with safe_open(str(shard), "pt") as handle:
            metadata = handle.metadata()
        tensors = load_file(str(shard))
        if layer == 0:
            tensors[name][BAD_A_LOG_ENTRY] = 0.5
        else:
            tensors[name] = tensors[name][:1].clone()
        save_file(tensors, str(shard), metadata=metadata)
    refresh_adoption_fingerprints(directory / "adopted")
    return directory / "adopted"


def run_all(dense_dir: str, out_dir: Path) -> None:
    rank = dist.get_rank()
    packed_dir = str(out_dir / "model")
    bad_dir = str(out_dir / "bad_scale")
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_packed_folder(Path(packed_dir))
        write_bad_scale_folder(Path(packed_dir), Path(bad_dir))
        write_adopted_release(out_dir / ADOPTED)
        write_bad_a_log_release(out_dir / BAD_A_LOG)
    dist.barrier()
    for mode in MODES:  # the dense plans' modes: this transformers' TP, EP and TP + EP
        run(packed_dir, out_dir, mode, rank, save=True)
        dist.barrier()
        # the load-time check of the packed groups on each rank's share: the rank holding the bad byte refuses,
        # naming the whole tensor's index; the other loads
        record_refusal(bad_dir, out_dir / f"bad-{mode}-rank{rank}.json", mode)
        dist.barrier()
        record_adopted(str(out_dir / ADOPTED / "adopted"), out_dir, mode, rank)
        dist.barrier()
    record_cut(dense_dir, out_dir, rank)
    dist.barrier()
    # the damaged release under TP 2: every rank's refusal (the same as one process's)
    record_refusal(str(out_dir / BAD_A_LOG / "adopted"), out_dir / f"bad-a-log-rank{rank}.json", "tp")
    dist.barrier()


def main(argv: list[str]) -> None:
    dense_dir, out_dir = argv
    dist.init_process_group("gloo")
    try:
        run_all(dense_dir, Path(out_dir))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
