"""Spreading the tiny model over devices on CPU: a device_map with CPU and disk offload, and tensor / expert parallel
plans on 2 gloo processes (tests/parallel_worker.py, and with the experts kept packed tests/packed_parallel_worker.py,
in the shared two-rank launch) and with the experts packed on 4 (tests/four_rank_worker.py, one launch after it), each
against the single-process model."""

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM



TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS.parent / "benchmarks"))

from packed_parallel_worker import (ADOPTED, BAD_A_LOG, BAD_A_LOG_ENTRY, BAD_EXPERT, BAD_SCALE,  # noqa: E402
                                    PACKED_OUT, adopted_results, forward_and_backward, logits_and_greedy,
                                    packed_holdings)
from parallel_worker import FOUR_RANK_MODES, HAS_EP_DISPATCH, INPUT_IDS, MODES, NEW_TOKENS  # noqa: E402



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


@pytest.fixture(scope="module")
def packed_runs(two_rank_runs):
    """The packed model's folder, its 2 gloo ranks' results per mode and the refusal of a cut group (`cut`)."""
    out_dir = two_rank_runs["parallel"] / PACKED_OUT
    runs = {mode: [{**json.loads((out_dir / f"{mode}-rank{rank}.json").read_text()),
                    **load_file(str(out_dir / f"{mode}-rank{rank}.safetensors"))} for rank in range(2)]
            for mode in MODES}
    cut = [json.loads((out_dir / f"cut-rank{rank}.json").read_text())["error"] for rank in range(2)]
    bad = {mode: [json.loads((out_dir / f"bad-{mode}-rank{rank}.json").read_text())["error"] for rank in range(2)]
           for mode in MODES}
    return out_dir / "model", runs, cut, bad


@pytest.fixture(scope="module")
def packed_reference(packed_runs):
    """The packed model in one process (f32): its holdings, logits, greedy tokens and gradients."""
    model = AutoModelForCausalLM.from_pretrained(packed_runs[0], trust_remote_code=True, dtype=torch.float32).eval()
    return model.config, packed_holdings(model), forward_and_backward(model)


@pytest.mark.parametrize("mode", MODES)
def test_packed_experts_stay_packed_sharded_and_match_one_process(packed_runs, packed_reference, mode):
    """TP splits each expert along its intermediate width (gate_up rows, down_proj's input dim in whole MXFP4 groups),
    EP hands each rank whole experts: every rank holds exactly half the packed bytes, in storage of its own, frozen;
    logits, greedy tokens and the gradients through the experts (to the input embeddings, and to the replicated
    projection feeding them) are the one process's."""
    config, whole, reference = packed_reference
    tp, ep = mode in ("tp", "tp_ep"), mode in ("ep", "tp_ep")
    e = config.num_experts // 2 if ep else config.num_experts
    i = config.moe_intermediate_size // 2 if (tp and not ep) else config.moe_intermediate_size
    groups_of = config.moe_intermediate_size // whole["shapes"]["down_proj_scale"][-1]  # values per scale
    latent = config.latent_size
    want = {"gate_up_proj_packed": [e, 2 * i, latent // 2], "gate_up_proj_scale": [e, 2 * i, latent // groups_of],
            "down_proj_packed": [e, latent, i // 2], "down_proj_scale": [e, latent, i // groups_of]}
    assert whole["shapes"] == {"gate_up_proj_packed": [config.num_experts, 2 * config.moe_intermediate_size,
                                                       latent // 2],
                               "gate_up_proj_scale": [config.num_experts, 2 * config.moe_intermediate_size,
                                                      latent // groups_of],
                               "down_proj_packed": [config.num_experts, latent, config.moe_intermediate_size // 2],
                               "down_proj_scale": [config.num_experts, latent, config.moe_intermediate_size
                                                   // groups_of]}
    for rank, run in enumerate(packed_runs[1][mode]):
        assert run["shapes"] == want and run["num_local_experts"] == e, f"rank {rank}"
        assert run["bytes"] == run["storage_bytes"] == whole["bytes"] // 2, f"rank {rank}"
        assert not run["requires_grad"]
        for name in ("logits", "grad_embeds", "grad_expert_feed"):
            torch.testing.assert_close(run[name], reference[name], rtol=1e-5, atol=1e-5, msg=f"{name}, rank {rank}")
        assert torch.equal(run["generated"], reference["generated"])


@pytest.mark.parametrize("mode", FOUR_RANK_MODES)
def test_packed_experts_on_four_ranks_hold_a_quarter_each_and_match_one_process(four_rank_runs, packed_reference,
                                                                                 mode):
    """The packed model (4 heads, 8 experts, 4 MXFP4 groups along the intermediate width: all cut 4 ways) on 4 gloo
    ranks (tests/four_rank_worker.py): TP 4 splits each expert's width into 4 whole-group slices, EP 4 (this
    transformers' `ep` or `tp_ep`) and `tp2_ep` (TP 2 inside each pair of ranks, EP over all 4: the multi-node
    layout) give each rank 2 whole experts. Every rank holds exactly a quarter of the packed bytes, in storage of its
    own, frozen; logits and greedy tokens are the one process's. A TP 2 x EP 2 grid with each expert split both by
    expert and by width is not expressible in transformers' API (parallel_worker.FOUR_RANK_MODES says why), nor TP
    with EP at all before 5.21."""
    config, whole, reference = packed_reference
    ep = mode != "tp"
    e = config.num_experts // 4 if ep else config.num_experts
    i = config.moe_intermediate_size if ep else config.moe_intermediate_size // 4
    groups = whole["shapes"]["down_proj_scale"][-1]
    latent = config.latent_size
    want = {"gate_up_proj_packed": [e, 2 * i, latent // 2],
            "gate_up_proj_scale": [e, 2 * i, whole["shapes"]["gate_up_proj_scale"][-1]],  # groups along the latent
            "down_proj_packed": [e, latent, i // 2],
            "down_proj_scale": [e, latent, groups if ep else groups // 4]}
    for rank in range(4):
        run = {**json.loads((four_rank_runs / f"{mode}-rank{rank}.json").read_text()),
               **load_file(str(four_rank_runs / f"{mode}-rank{rank}.safetensors"))}
        assert run["shapes"] == want and run["num_local_experts"] == e, f"rank {rank}"
        assert run["bytes"] == run["storage_bytes"] == whole["bytes"] // 4 and not run["requires_grad"], f"rank {rank}"
        torch.testing.assert_close(run["logits"], reference["logits"], rtol=1e-5, atol=1e-5, msg=f"rank {rank}")
        assert torch.equal(run["generated"], reference["generated"]), f"rank {rank}"


@pytest.mark.parametrize("mode", MODES)
def test_save_pretrained_of_the_sharded_packed_model_writes_the_whole_folder(packed_runs, packed_reference, mode):
    """save_pretrained on both ranks of the sharded packed model: transformers gathers every shard (the other rank's
    through the process group) and rank 0 alone writes our layout, under a temporary name renamed when complete
    (saving_kimi_k3.save_folder). The folder holds every tensor of the one-process model, bit for bit, with its code
    files, and loads in one process with the same logits and greedy tokens; no temporary folder is left."""
    from kimik3.modeling.saving_kimi_k3 import PARTIAL_SUFFIX

    packed_dir, (_, whole, reference) = packed_runs[0], packed_reference
    saved = packed_dir.parent / f"saved-{mode}"
    assert not [p.name for p in packed_dir.parent.iterdir() if p.name.endswith(PARTIAL_SUFFIX)]
    original, written = load_file(str(packed_dir / "model.safetensors")), load_file(str(saved / "model.safetensors"))
    assert sorted(written) == sorted(original)
    for name, tensor in original.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), name
    assert (saved / "modeling_kimi_k3.py").is_file() and "AutoModelForCausalLM" in json.loads(
        (saved / "config.json").read_text())["auto_map"]
    model = AutoModelForCausalLM.from_pretrained(saved, trust_remote_code=True, dtype=torch.float32).eval()
    results = logits_and_greedy(model)
    assert packed_holdings(model)["bytes"] == whole["bytes"]
    torch.testing.assert_close(results["logits"], reference["logits"], rtol=0, atol=0)
    assert torch.equal(results["generated"], reference["generated"])


def test_sharded_save_that_fails_leaves_nothing_that_looks_finished_and_a_later_one_replaces_the_folder(
        tmp_path, monkeypatch):
    """The writing rank's side of a sharded save, in one process (rank 0 of a group stood in for): a save failing
    half-way (another rank's gather raising) leaves the folder asked for absent, its partial files under the hidden
    temporary name only; the next save clears those, and over an existing folder replaces its config and weights
    (a weight shard of the old save that the new lacks removed) and keeps its other files."""
    import functools

    import torch.distributed as dist
    from transformers import PreTrainedModel

    from kimik3.modeling import saving_kimi_k3 as saving
    from kimik3.tiny import build_tiny_model

    monkeypatch.setattr(saving, "_is_sharded", lambda model: True)
    monkeypatch.setattr(dist, "get_rank", lambda *args: 0)
    monkeypatch.setattr(dist, "barrier", lambda *args: None)
    model = build_tiny_model()
    target = tmp_path / "saved"
    partial = tmp_path / f"{saving.PARTIAL_PREFIX}saved{saving.PARTIAL_SUFFIX}"

    def failing(directory, **kwargs):
        model.config.save_pretrained(directory)
        raise RuntimeError("a rank's gather failed")

    with pytest.raises(RuntimeError, match="gather failed"):
        saving.save_folder(model, failing, target)
    assert not target.exists() and (partial / "config.json").is_file()
    target.mkdir()
    for name in ("config.json", "model-00002-of-00002.safetensors", "tokenizer.json"):
        (target / name).write_text("old")
    saving.save_folder(model, functools.partial(PreTrainedModel.save_pretrained, model), target)
    assert not partial.exists() and (target / "tokenizer.json").read_text() == "old"
    assert not (target / "model-00002-of-00002.safetensors").exists()
    assert json.loads((target / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"].endswith(
        "KimiK3ForCausalLM")
    written = load_file(str(target / "model.safetensors"))
    assert torch.equal(written["lm_head.weight"], model.lm_head.weight.detach())


def test_packed_experts_tensor_parallel_refuses_a_degree_that_cuts_an_mxfp4_group(packed_runs):
    """The tiny model's intermediate width is one group of 32: 2 tensor-parallel ranks would cut it. The load stops
    when the plan is applied, naming the tensor, on both ranks."""
    for error in packed_runs[2]:
        assert error is not None and error.startswith("`model.layers.1.mlp.experts.down_proj_packed`: its 1 MXFP4 "
                                                      "group(s) along the input dim cannot be split over 2")


@pytest.mark.parametrize("mode", MODES)
def test_packed_experts_bad_scale_refused_by_the_rank_holding_it_with_the_whole_tensors_index(packed_runs,
                                                                                            packed_reference, mode):
    """Each rank checks its own share of the packed groups at load (no collective): the byte is on rank 1 under TP (the
    last up row, local row I - 1 of the strided gate/up split) and under EP (expert 5 = local expert 1); the message
    gives the release tensor and the index into the whole fused tensor."""
    config = packed_reference[0]
    row = 2 * config.moe_intermediate_size - 1
    layer = config.mlp_layer_types.index("sparse")
    errors = packed_runs[3][mode]
    assert errors[0] is None
    assert errors[1] is not None and errors[1].startswith("KimiK3LoadError: ") and (
        f"`model.layers.{layer}.block_sparse_moe.experts.{BAD_EXPERT}.w3.weight_scale` (our "
        f"`model.layers.{layer}.mlp.experts.{BAD_SCALE}`): E8M0 scale byte 0xFF at [{BAD_EXPERT}, {row}, 0]"
        in errors[1]), errors[1]


@pytest.fixture(scope="module")
def adopted_reference(two_rank_runs):
    """The adopted release in one process (f32): its packed holdings, logits and greedy tokens, and the elements of
    each tensor of its state dict."""
    folder = two_rank_runs["parallel"] / PACKED_OUT / ADOPTED / "adopted"
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    return (*adopted_results(model), {name: tensor.numel() for name, tensor in model.state_dict().items()})


@pytest.mark.parametrize("mode", MODES)
def test_adopted_release_with_packed_experts_under_tensor_and_expert_parallel(two_rank_runs, adopted_reference, mode):
    """The release layout on disk (an adopted folder's links, per-expert w1/w2/w3 codes and scales fused by the
    loader, A_log zero-padded to 128) with experts_format="mxfp4", under this transformers' TP, EP and TP + EP: each
    rank holds half the packed bytes (its whole experts, or under TP alone half of each expert's width), frozen, with
    the logits and greedy tokens of one process. The tiny release has 2 KDA heads: under TP rank 1's head is in the
    half of the padded A_log that rank 0 read, so the loader's share of the file alone would give it a zero."""
    out_dir = two_rank_runs["parallel"] / PACKED_OUT
    runs = [json.loads((out_dir / f"adopted-{mode}-rank{rank}.json").read_text()) for rank in range(2)]
    whole, reference = adopted_reference[:2]
    ep = mode in ("ep", "tp_ep")
    assert whole["num_local_experts"] == 4 and whole["bytes"] > 0
    halved = {k: ([v[0] // 2, *v[1:]] if ep else [v[0], v[1] // 2, v[2]] if k.startswith("gate_up") else
                  [*v[:2], v[2] // 2]) for k, v in whole["shapes"].items()}
    for rank, run in enumerate(runs):
        assert run["error"] is None, f"rank {rank}: {run['error']}"
        assert run["num_local_experts"] == (2 if ep else 4), f"rank {rank}"
        assert run["bytes"] == run["storage_bytes"] == whole["bytes"] // 2 and not run["requires_grad"], f"rank {rank}"
        assert run["shapes"] == halved, f"rank {rank}"
        results = load_file(str(out_dir / f"adopted-{mode}-rank{rank}.safetensors"))
        torch.testing.assert_close(results["logits"], reference["logits"], rtol=1e-5, atol=1e-5)
        assert torch.equal(results["generated"], reference["generated"])


@pytest.mark.parametrize("mode", MODES)
def test_a_sharded_release_loaded_model_saves_the_release_layout_whole(two_rank_runs, mode):
    """save_pretrained of the adopted release loaded under this mode writes the release layout back from the ranks'
    shards: the release's own tensor names, every tensor's values (bf16 in the release, f32 as loaded), packed
    experts and their scales byte for byte, in a folder that one process loads."""
    out_dir = two_rank_runs["parallel"] / PACKED_OUT
    release = _all_tensors(out_dir / ADOPTED / "adopted")
    saved = _all_tensors(out_dir / f"adopted-saved-{mode}")
    assert sorted(saved) == sorted(release)
    for name, tensor in release.items():
        if saved[name].shape != tensor.shape:
            # transformers 5.17-5.20's SplitModulelist squeezes every size-1 dim on save: the per-expert [rows, 1]
            # scales come out [rows] (their load, and ours, read both); 5.21+ keep the release's shape
            assert not HAS_EP_DISPATCH and tensor.shape[-1] == 1 and saved[name].shape == tensor.shape[:-1], name
            saved[name] = saved[name].unsqueeze(-1)
        if tensor.dtype == torch.uint8:
            assert saved[name].dtype == torch.uint8 and torch.equal(saved[name], tensor), name
        else:
            assert torch.equal(saved[name].to(tensor.dtype), tensor), name
    AutoModelForCausalLM.from_pretrained(out_dir / f"adopted-saved-{mode}", trust_remote_code=True,
                                         experts_format="mxfp4")


def _all_tensors(folder: Path) -> dict[str, torch.Tensor]:
    index_path = folder / "model.safetensors.index.json"
    files = set(json.loads(index_path.read_text())["weight_map"].values()) if index_path.exists() else {
        "model.safetensors"}
    out = {}
    for file in sorted(files):
        out.update(load_file(str(folder / file)))
    return out


@pytest.fixture(scope="module")
def bad_a_log_refusals(two_rank_runs):
    """The damaged adopted release (packed_parallel_worker.write_bad_a_log_release): its folder, the one process's
    refusal and each TP rank's."""
    out_dir = two_rank_runs["parallel"] / PACKED_OUT
    bad_dir = out_dir / BAD_A_LOG / "adopted"
    with pytest.raises(ValueError) as refused:  # KimiK3LoadError, from the folder's own copy of the code
        AutoModelForCausalLM.from_pretrained(bad_dir, trust_remote_code=True, dtype=torch.float32)
    ranks = [json.loads((out_dir / f"bad-a-log-rank{rank}.json").read_text())["error"] for rank in range(2)]
    return bad_dir, f"{type(refused.value).__name__}: {refused.value}", ranks


@pytest.mark.parametrize("layer, fragment", [
    pytest.param(0, "entries 2..127 must be the +0.0 padding of a 2-head A_log", id="tp-a-log-nonzero-tail-one-rank"),
    pytest.param(1, "expected a 1-D tensor of length >= 2 (one entry per head, zero-padded), found shape [1]",
                 id="tp-a-log-shorter-than-heads"),
])
def test_adopted_release_with_a_bad_a_log_is_refused_under_tensor_parallel_as_in_one_process(bad_a_log_refusals,
                                                                                           layer, fragment):
    """A non-zero value in A_log's padding at an entry only rank 1's share of the file holds (layer 0), an A_log
    shorter than the heads, of which rank 1 reads nothing (layer 1): under TP 2 both ranks refuse with the one
    process's message, which names the folder, each tensor and its weights file."""
    bad_dir, one_process, ranks = bad_a_log_refusals
    assert one_process.startswith(f"KimiK3LoadError: {bad_dir}: ") and BAD_A_LOG_ENTRY > 64  # rank 1's half of 128
    assert re.search(rf"`language_model\.model\.layers\.{layer}\.self_attn\.A_log`: {re.escape(fragment)}[^;]* "
                     r"\(file model-\d+-of-\d+\.safetensors\)", one_process), one_process
    assert ranks == [one_process, one_process]


def _file_tensors(folder: Path) -> dict[str, int]:
    """{tensor: its bytes in the folder's weights files} (the safetensors headers, through the folder's links)."""
    from kimik3.modeling.files_kimi_k3 import read_safetensors_header

    index = folder / "model.safetensors.index.json"
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [
        "model.safetensors"]
    sizes = {}
    for shard in shards:
        for name, (_, _, first, end) in read_safetensors_header(folder / shard)[0].items():
            sizes[name] = end - first
    return sizes


def _our_name(release: str) -> str:
    """The parameter a release tensor loads into (release_layout_kimi_k3's release name map): per-expert parts into the
    fused packed tensors, the MoE block renamed; any other name is ours already."""
    from kimik3.modeling.release_layout_kimi_k3 import (EXPERT_PARTS, MOE_CHILDREN, OUR_MOE_BLOCK, OUR_PACKED_SUFFIXES,
                                                    RELEASE_MOE_BLOCK)

    expert = re.fullmatch(rf"(.*\.){RELEASE_MOE_BLOCK}\.experts\.\d+\.(\w+)\.(weight_packed|weight_scale)", release)
    if expert:
        fused = next(f for f, parts in EXPERT_PARTS.items() if expert[2] in parts)
        return f"{expert[1]}{OUR_MOE_BLOCK}.experts.{fused}{OUR_PACKED_SUFFIXES[expert[3]]}"
    return re.sub(rf"\.{RELEASE_MOE_BLOCK}\.{MOE_CHILDREN}", rf".{OUR_MOE_BLOCK}.\1", release)


def read_against_share(folder: Path, load: dict, whole_numel: dict[str, int]) -> dict[str, tuple[int, float]]:
    """{parameter: (bytes this rank read of the checkpoint tensors it loads from, its share of them)}: the share of a
    tensor is its bytes in the files times the fraction of the parameter the rank holds (its local elements over the
    one process's), so a replicated tensor is read whole, an expert stack in half on 2 ranks, whatever the layout."""
    sizes = _file_tensors(folder)
    assert set(load["reads"]) <= set(sizes), sorted(set(load["reads"]) - set(sizes))
    result = {}
    for name, size in sizes.items():
        target = _our_name(name)
        read, share = result.get(target, (0, 0.0))
        result[target] = (read + load["reads"].get(name, 0),
                          share + size * load["held_numel"][target] / whole_numel[target])
    return result


# The peak resident growth of a rank's load beyond the bytes it holds afterwards: a fixed overhead (the loader's
# objects, the pages of the mmap-ed shards it touched, the op transients of one tensor), and more for the first
# measured load of a forked rank (load_reads.py, packed_parallel_worker._LOADED). Measured: 0.4-6 MiB, 23-32 MiB
# first (a rank holding 0.36-0.72 MB).
RSS_SLACK, FIRST_LOAD_RSS_SLACK = 8 << 20, 48 << 20


def _whole_numel_of_our_layout(folder: Path) -> dict[str, int]:
    """Our layout stores every tensor of the state dict at its full shape under its own name."""
    import math

    from kimik3.modeling.files_kimi_k3 import read_safetensors_header

    return {name: math.prod(shape) for name, (_, shape, _, _) in
            read_safetensors_header(folder / "model.safetensors")[0].items()}


@pytest.mark.parametrize("layout, mode, ranks", [*(("ours", mode, 2) for mode in MODES),
                                                 *(("release", mode, 2) for mode in MODES),
                                                 *(("ours", mode, 4) for mode in FOUR_RANK_MODES)])
def test_each_rank_reads_only_its_share_of_the_checkpoint_with_bounded_memory(two_rank_runs, four_rank_runs,
                                                                              adopted_reference, layout, mode, ranks):
    """Counted at the slice reads of transformers' safetensors files (load_reads.py): under TP, EP, TP + EP (and on 4
    ranks tp2_ep), in our layout and in the release layout (an adopted folder: per-expert parts fused by the loader,
    A_log padded), each rank reads of each parameter's checkpoint tensors no more than its share (the file bytes
    times the fraction of the parameter it holds: replicated tensors whole, each expert stack 1/N), so in total
    exactly the dense tensors it needs and its experts' bytes, no slack; a rank reading a whole tensor and keeping a
    part fails. Each load's peak resident growth is its held bytes plus a fixed RSS_SLACK."""
    out_dir = two_rank_runs["parallel"] / PACKED_OUT
    if layout == "ours":
        folder, whole = out_dir / "model", _whole_numel_of_our_layout(out_dir / "model")
        runs = out_dir if ranks == 2 else four_rank_runs
        records = [json.loads((runs / f"{mode}-rank{rank}.json").read_text()) for rank in range(ranks)]
    else:
        folder, whole = out_dir / ADOPTED / "adopted", adopted_reference[2]
        records = [json.loads((out_dir / f"adopted-{mode}-rank{rank}.json").read_text()) for rank in range(ranks)]
    checkpoint = sum(_file_tensors(folder).values())
    for rank, record in enumerate(records):
        load = record["load"]
        per_parameter = read_against_share(folder, load, whole)
        over = {name: pair for name, pair in per_parameter.items() if pair[0] > pair[1]}
        assert not over, f"rank {rank} read more than its share of: {over}"
        read, share = sum(r for r, _ in per_parameter.values()), sum(s for _, s in per_parameter.values())
        assert read == pytest.approx(share, abs=1) and read < checkpoint, (rank, read, share, checkpoint)
        slack = FIRST_LOAD_RSS_SLACK if load["first_load"] else RSS_SLACK
        assert load["rss_growth"] <= load["held_bytes"] + slack, (rank, load["rss_growth"], load["held_bytes"])


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
