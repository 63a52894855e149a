"""`kimik3 memory --plan`: weight bytes from the config's shapes against an instantiated model and the release's
index, the device split, the units, and bad input."""

import json
from pathlib import Path

import pytest
import torch

from kimik3.cli import main
from kimik3.memory import (
    RELEASE_A_LOG_PADDING_BYTES,
    RELEASE_TOTAL_SIZE,
    RELEASE_VISION_BYTES,
    device_plan,
    load_text_config,
    memory_table,
    parallel_plan,
    parse_gpu_memory,
    parse_tokens,
    search_degrees,
    unit_bytes,
    weight_units,
)
from kimik3.tiny import build_tiny_model


def _loaded_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


@pytest.fixture(scope="module", params=["dense", "mxfp4"])
def loaded_tiny(request, tmp_path_factory):
    """A tiny model saved and loaded in bf16 the way users load it (F32 tensors kept F32, packed experts uint8)."""
    from kimik3.configuration import tiny_text_config_dict
    from kimik3.modeling.configuration_kimi_k3 import KimiK3TextConfig
    from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM

    directory = tmp_path_factory.mktemp(f"tiny-{request.param}")
    config = KimiK3TextConfig(**{**tiny_text_config_dict(num_hidden_layers=4), "experts_format": request.param})
    KimiK3ForCausalLM(config).save_pretrained(directory)
    return request.param, KimiK3ForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)


def test_weight_bytes_equal_the_loaded_models_tensors(loaded_tiny):
    experts_format, model = loaded_tiny
    units = dict(weight_units(model.config, experts_format))
    # same tensors, same shapes, same dtypes, unit by unit
    state = model.state_dict()
    predicted = {name: spec for tensors in units.values() for name, spec in tensors.items()}
    assert set(predicted) == set(state)
    dtype_names = {torch.bfloat16: "bf16", torch.float32: "f32", torch.uint8: "u8"}
    for name, (shape, dtype) in predicted.items():
        assert (tuple(state[name].shape), dtype_names[state[name].dtype]) == (shape, dtype), name
    for index, layer in enumerate(model.model.layers):
        assert unit_bytes(units[f"layers.{index}"]) == _loaded_bytes(layer)
    assert sum(unit_bytes(t) for t in units.values()) == _loaded_bytes(model)
    assert any(dtype == "f32" for _, dtype in predicted.values())
    if experts_format == "mxfp4":
        assert any(dtype == "u8" for _, dtype in predicted.values())


def test_release_weights_match_the_index_total_size():
    """k3_checkpoint.md §2.1: the index's total_size is 1,560,860,324,864 bytes, of which the vision tower and the
    projector are not our text model, and A_log is stored padded to 128 heads. What is left must be our count;
    tolerance 0 bytes (stated: exact), and the MXFP4 experts alone are 82,432 x 17,547,264 bytes."""
    config = load_text_config(None)
    units = weight_units(config, "mxfp4")
    total = sum(unit_bytes(t) for _, t in units)
    assert total == RELEASE_TOTAL_SIZE - RELEASE_VISION_BYTES - RELEASE_A_LOG_PADDING_BYTES
    experts = sum(unit_bytes({k: v for k, v in t.items() if ".experts." in k}) for _, t in units)
    assert experts == 82_432 * 17_547_264 == 1_446_456_066_048
    # dense (bf16) experts: 2 bytes per value instead of 0.53125; the default is the release's own format
    assert sum(unit_bytes(t) for _, t in weight_units(config, "dense")) - total == experts * (2 / 0.53125 - 1)
    assert weight_units(config) == units


@pytest.mark.parametrize("text,expected", [("141GB", 141 * 10**9), ("141GiB", 141 * 2**30), ("141gib", 141 * 2**30),
                                           ("141gb", 141 * 10**9), ("512MiB", 512 * 2**20), ("1000", 1000)])
def test_gpu_memory_units(text, expected):
    assert parse_gpu_memory(text) == expected


@pytest.mark.parametrize("text,expected", [("1M", 2**20), ("128K", 131072), ("128k", 131072), ("4096", 4096)])
def test_context_units(text, expected):
    assert parse_tokens(text) == expected


def test_release_plan_verdict_and_smallest_gpu_count():
    config = load_text_config(None)
    gpu = 141 * 10**9
    plan = device_plan(config, 8, gpu, 2**20)
    assert not plan["fits"]
    smallest = plan["smallest_gpus"]
    assert device_plan(config, smallest, gpu, 2**20)["fits"]
    assert not device_plan(config, smallest - 1, gpu, 2**20)["fits"]
    # every byte is placed once; the cache per device adds up to the cache table's total
    assert sum(d["weights"] for d in plan["devices"]) == plan["weights"]
    cache_total = memory_table(config, (2**20,))[0]["k3_total"]
    assert sum(d["cache"] for d in plan["devices"]) == plan["cache"] == cache_total
    for device in device_plan(config, smallest, gpu, 2**20)["devices"]:
        assert device["left"] == gpu - device["weights"] - device["cache"] >= 0
    # the cache grows with context and batch, the weights do not
    bigger = device_plan(config, smallest, gpu, 2**20, batch_size=4)
    assert bigger["cache"] > 3 * plan["cache"] and bigger["weights"] == plan["weights"]


def test_plan_cli_prints_units_and_verdicts(capsys, tmp_path):
    assert main(["memory", "--plan", "--gpus", "8", "--gpu-mem", "141GB", "--context", "1M", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)  # pure JSON
    assert main(["memory", "--plan", "--gpus", "8", "--gpu-mem", "141GB", "--context", "1M"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT on 8 x 141.00 GB" in out and "GB = 10^9 bytes, GiB = 2^30 bytes" in out
    assert f"smallest number of devices that fits is {plan['smallest_gpus']}" in out
    assert main(["memory", "--plan", "--gpus", str(plan["smallest_gpus"]), "--gpu-mem", "141GB"]) == 0
    assert "FITS on" in capsys.readouterr().out
    # a slice from --config, in GiB
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(build_tiny_model(num_hidden_layers=4).config.to_dict()))
    assert main(["memory", "--plan", "--gpus", "2", "--gpu-mem", "1GiB", "--config", str(config_path),
                 "--experts-format", "dense", "--context", "4K"]) == 0
    out = capsys.readouterr().out
    assert "FITS on 2 x 1.00 GiB" in out and "4 layers (3 KDA, 1 MLA)" in out and "4,096 tokens" in out


@pytest.mark.parametrize("argv,message", [
    (["--plan", "--gpus", "8", "--gpu-mem", "141XB"], "argument --gpu-mem: '141XB' is not a size"),
    (["--plan", "--gpus", "8", "--gpu-mem", "1.5GB"], "argument --gpu-mem: '1.5GB' is not a size"),
    (["--plan", "--gpus", "0", "--gpu-mem", "141GB"], "argument --gpus: 0 must be at least 1"),
    (["--plan", "--gpus", "8", "--gpu-mem", "141GB", "--context", "1.5M"], "argument --context: '1.5M' is not"),
    (["--plan", "--gpus", "8", "--gpu-mem", "141GB", "--context", "2M"], "argument --context: 2,097,152 tokens is "
                                                                          "more than the model's"),
    (["--plan", "--gpus", "8", "--gpu-mem", "141GB", "--experts-format", "fp8"], "argument --experts-format: "
                                                                                  "invalid choice: 'fp8'"),
    (["--plan", "--gpus", "8"], "argument --plan: needs --gpu-mem"),
    (["--plan", "--gpu-mem", "141GB"], "argument --plan: needs --gpus"),
    (["--gpus", "8"], "argument --gpus: only with --plan"),
    pytest.param(["--plan", "--gpus", "1000000000", "--gpu-mem", "141GB"], "argument --plan: 1,000,000,000 devices is "
                 "more than the 1,048,576 a plan covers", id="plan-gpus-1e9"),
    pytest.param(["--plan", "--nodes", "100000", "--gpus-per-node", "100000", "--gpu-mem", "141GB"],
                 "argument --plan: 10,000,000,000 devices is more than", id="plan-nodes-times-gpus-1e10"),
])
def test_plan_bad_input_exits_2_naming_the_option(capsys, argv, message):
    assert main(["memory", *argv]) == 2
    err = capsys.readouterr().err
    assert "kimik3 memory: error: " + message in err


def test_memory_table_units_state_dtype_json_and_the_quoted_figures(capsys, tmp_path):
    release = load_text_config(None)
    f32, bf16 = (memory_table(release, (128_000,), state_dtype=d)[0] for d in ("float32", "bfloat16"))
    assert f32["k3_kda_state"] == 2 * bf16["k3_kda_state"] == 69 * 96 * 128 * 128 * 4
    assert f32["k3_total"] - bf16["k3_total"] == bf16["k3_kda_state"]
    assert main(["memory", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == memory_table(release, (131072, 1048576))
    assert main(["memory", "--units", "GB", "--state-dtype", "bfloat16", "--tokens", "128000"]) == 0
    assert "0.217 GB" in capsys.readouterr().out
    # every quoted figure is reproduced under its own assumptions, and the JSON says so
    assert main(["memory", "--reconcile", "--json"]) == 0
    quoted = json.loads(capsys.readouterr().out)["reconciliation"]
    assert [q["quoted"] for q in quoted] == ["0.22 GB", "3.5 GB", "29 GB", "13.7 GB", "107 GB"]
    assert all(q["matches"] for q in quoted)
    assert main(["memory", "--reconcile"]) == 0
    out = capsys.readouterr().out
    assert out.count("matches") == 5 and "107,136,000,000 B" in out and "0.404 GiB" in out
    # a tiny model's table picks a unit in which its figures are not zeros
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(build_tiny_model(num_hidden_layers=4).config.to_dict()))
    assert main(["memory", "--config", str(config_path)]) == 0
    out = capsys.readouterr().out
    assert "KiB" in out and " 0.000 " not in out
    assert main(["memory", "--reconcile", "--config", str(config_path)]) == 2
    assert "kimik3 memory: error: argument --reconcile" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------
# The per-rank plan of a parallel layout, against what two gloo ranks really hold


def _rank_bytes_entry(rank: int, port: int, model_dir: str, out_dir: str, modes) -> None:
    """One of two forked gloo ranks: load the folder under each mode's plan in bf16, run one forward with a cache,
    and write the bytes of this rank's local parameters and buffers and of its cache."""
    import os
    import warnings

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from parallel_worker import INPUT_IDS, distributed_kwargs

    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", GROUP_RANK="0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        for mode in modes:
            model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True, dtype=torch.bfloat16,
                                                         **distributed_kwargs(mode)).eval()
            local = lambda t: getattr(t, "to_local", lambda: t)()  # noqa: E731
            held = sum(local(t).numel() * local(t).element_size()
                       for t in [*model.parameters(), *model.buffers()])
            with torch.no_grad():
                output = model(input_ids=torch.tensor(INPUT_IDS), use_cache=True)
            cache = output.cache if hasattr(output, "cache") else output.past_key_values
            live = cache.live_bytes()
            (Path(out_dir) / f"{mode}-rank{rank}.json").write_text(json.dumps(
                {"weights": held, "cache": live["mla_kv"] + live["kda_state"] + live["kda_conv"]}))
            dist.barrier()
    finally:
        dist.destroy_process_group()


# the layouts the parallel tests run, as (tp, ep) degrees of the plan
MODE_DEGREES = {"tp": (2, 1), "ep": (1, 2), "tp_ep": (2, 2)}


@pytest.fixture(scope="module")
def rank_bytes(tmp_path_factory):
    import socket

    import torch.multiprocessing as mp

    from kimik3.tiny import write_tiny_folder
    from parallel_worker import MODES

    root = tmp_path_factory.mktemp("rank_bytes")
    write_tiny_folder(root / "tiny")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # join=True: a rank that raised fails here, with its traceback
    mp.start_processes(_rank_bytes_entry, args=(port, str(root / "tiny"), str(root), MODES), nprocs=2,
                       start_method="fork")
    config = load_text_config(root / "tiny" / "config.json")
    return config, {mode: [json.loads((root / f"{mode}-rank{r}.json").read_text()) for r in range(2)]
                    for mode in MODES}


def test_parallel_plan_per_rank_bytes_equal_what_two_gloo_ranks_hold(rank_bytes):
    """Exact bytes: the plan's weights and cache per rank against the ranks' local parameters, buffers and live
    cache after a forward of 2 sequences x 8 tokens, for every layout the parallel tests run."""
    from parallel_worker import INPUT_IDS

    config, runs = rank_bytes
    one = parallel_plan(config, 1, 1, 10**9, 1, 1, len(INPUT_IDS[0]), batch_size=len(INPUT_IDS),
                        experts_format="dense")
    for mode, per_rank in runs.items():
        tp, ep = MODE_DEGREES[mode]
        plan = parallel_plan(config, 1, 2, 10**9, tp, ep, len(INPUT_IDS[0]), batch_size=len(INPUT_IDS),
                             experts_format="dense")
        assert plan["stages"] == 1 and plan["not_runnable"] is None, mode
        rank = plan["stage_ranks"][0]
        for run in per_rank:
            assert (run["weights"], run["cache"]) == (rank["weights"]["total"], rank["cache"]), mode
        # the layout really splits something: less than one process holds
        assert rank["weights"]["total"] < one["stage_ranks"][0]["weights"]["total"], mode
        if tp > 1:
            assert rank["cache"] < one["stage_ranks"][0]["cache"], mode  # KDA state split by head


def test_two_nodes_of_h200_at_1m_tokens_say_what_fits_and_how(capsys):
    config = load_text_config(None)
    best, candidates = search_degrees(config, 2, 8, 141 * 10**9, 2**20)
    # The packed prefill's transient is its row split or one 1 GiB chunk of dequantised experts (no longer a layer's
    # whole stack in bf16). With it TP 16 in one stage fits 1M tokens where the installed transformers splits the
    # embeddings by vocabulary (5.24); where it replicates them (5.17) TP 16 is 1.95 GB over and TP 8 in two
    # whole-layer stages fits, which this version cannot run (no pipeline plan across processes)
    tp16 = next(c for c in candidates if (c["tp"], c["ep"], c["stages"]) == (16, 1, 1))
    layout = (16, 1, 1) if tp16["fits"] else (8, 1, 2)
    assert best["fits"] and (best["tp"], best["ep"], best["stages"]) == layout
    assert (best["not_runnable"] is None) == tp16["fits"]
    # every rank: weights + cache + workspace + left = the device
    for s in best["stage_ranks"]:
        assert s["weights"]["total"] + s["cache"] + s["workspace"] + s["left"] == 141 * 10**9
    # all ranks together hold every weight byte once per replica of the dense parts
    assert sum(s["weights"]["experts"] for s in best["stage_ranks"]) * best["ranks_per_stage"] == sum(
        unit_bytes({k: v for k, v in t.items() if ".experts." in k}) for _, t in weight_units(config, "mxfp4"))
    dense = search_degrees(config, 2, 8, 141 * 10**9, 2**20, experts_format="dense")[0]
    assert not dense["fits"]  # 5.45 TB of bf16 experts do not fit 16 x 141 GB
    assert main(["memory", "--plan", "--nodes", "2", "--gpus-per-node", "8", "--gpu-mem", "141GB", "--context",
                 "1M"]) == 0
    out = capsys.readouterr().out
    assert f"tp {layout[0]}, ep 1 ({layout[0]} ranks a replica), {layout[2]} whole-layer stage(s)" in out
    assert "verdict: FITS" in out and f"chosen from {len(candidates)} layouts" in out
    assert ("not runnable with this version" in out) != tp16["fits"]
    assert main(["memory", "--plan", "--nodes", "2", "--gpus-per-node", "8", "--gpu-mem", "141GB", "--tp", "8",
                 "--ep", "8", "--json", "--hbm-bandwidth", "4.3TB/s"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["tp"], plan["ep"], plan["hbm_bandwidth"]) == (8, 8, 4.3e12)
    assert plan["decode_step_ms"] == pytest.approx(sum(s["decode_bytes"] for s in plan["stage_ranks"]) / 4.3e9)


@pytest.mark.parametrize("argv,message", [
    pytest.param(["--tp", "3"], "argument --tp: 3 ranks a model replica do not divide the world size 8",
                 id="memory-plan-tp-not-dividing-world"),
    pytest.param(["--gpus-per-node", "12", "--gpus", "12", "--tp", "3", "--ep", "1"],
                 "argument --tp: 3 does not divide ",  # the embeddings (transformers 5.24 splits them) or lm_head
                 id="memory-plan-tp-not-dividing-vocab"),
    pytest.param(["--tp", "8", "--ep", "7"], "argument --ep: 7 is not a multiple of --tp 8",
                 id="memory-plan-ep-not-multiple-of-tp"),
    pytest.param(["--gpus", "6", "--tp", "1", "--ep", "6"], "argument --ep: 6 does not divide num_experts=896",
                 id="memory-plan-ep-not-dividing-experts"),
    pytest.param(["--gpus", "5", "--tp", "5", "--ep", "1"], "argument --tp: 5 does not divide "
                 "num_attention_heads=96", id="memory-plan-tp-not-dividing-heads"),
    pytest.param(["--nodes", "0", "--gpus-per-node", "8"], "argument --nodes: 0 must be at least 1",
                 id="memory-plan-nodes-zero"),
    pytest.param(["--gpus-per-node", "4"], "argument --gpus: 8 contradicts --nodes 1 x --gpus-per-node 4",
                 id="memory-plan-gpus-contradicts-per-node"),
    pytest.param(["--nodes", "2"], "argument --gpus: with --nodes, give --gpus-per-node",
                 id="memory-plan-gpus-with-nodes"),
    pytest.param(["--hbm-bandwidth", "4.3TBs"], "argument --hbm-bandwidth: '4.3TBs' is not a bandwidth",
                 id="memory-plan-bandwidth-typo"),
    pytest.param(["--tp", "0"], "argument --tp: 0 must be at least 1", id="memory-plan-tp-zero"),
])
def test_parallel_plan_bad_input_exits_2_naming_the_option(capsys, argv, message):
    base = ["memory", "--plan", "--gpu-mem", "141GB"]
    if "--gpus" not in argv and "--gpus-per-node" not in argv:
        base += ["--gpus", "8"]
    elif "--gpus" not in argv:
        base += ["--gpus", "8"] if "--nodes" not in argv else []
    assert main([*base, *argv]) == 2
    assert "kimik3 memory: error: " + message in capsys.readouterr().err


def test_parallel_options_only_with_plan(capsys):
    assert main(["memory", "--tp", "8"]) == 2
    assert "argument --tp: only with --plan" in capsys.readouterr().err


# ----- the offload tiers: routed experts in host memory, the rest and an expert cache on one GPU -----

def test_offload_plan_counts_the_loaded_experts_bytes(loaded_tiny):
    from kimik3.memory import offload_plan
    from kimik3.modeling.modeling_kimi_k3 import KimiK3Experts
    from kimik3.modeling.offload_kimi_k3 import expert_bytes

    experts_format, model = loaded_tiny
    modules = [m for m in model.modules() if isinstance(m, KimiK3Experts)]
    plan = offload_plan(model.config, 10**9, 10**9, 256, experts_format=experts_format)
    assert plan["bytes_per_expert"] == expert_bytes(modules[0].stacks())
    assert plan["host"]["experts"] == sum(t.numel() * t.element_size() for m in modules for t in m.stacks())
    assert plan["moe_layers"] == len(modules)


@pytest.mark.parametrize("experts,top_k,batch,cached,steps", [(8, 2, 2, 3, 600), (896, 16, 8, 100, 120)])
def test_expected_moved_experts_equal_the_offload_caches_counters(experts, top_k, batch, cached, steps):
    """The plan's formula against the cache's own `moves` under uniform routing (fixed seed, after the cache
    fills); the tolerance is a few standard errors of the simulated mean."""
    from kimik3.memory import expected_moved_experts
    from kimik3.modeling.offload_kimi_k3 import ExpertCache

    cache = ExpertCache(cached * 4, 1, 4)  # one layer, 4-byte experts: capacity `cached`
    stacks = (torch.zeros(experts, 1),)
    generator = torch.Generator().manual_seed(0)
    draw = lambda: torch.stack([torch.randperm(experts, generator=generator)[:top_k]  # noqa: E731
                                for _ in range(batch)])
    for _ in range(20):  # fill the cache
        cache.gather(0, draw(), stacks, torch.device("cpu"))
    before = cache.moves
    for _ in range(steps):
        cache.gather(0, draw(), stacks, torch.device("cpu"))
    assert cache.resident_bytes() <= cache.budget_bytes
    simulated = (cache.moves - before) / steps
    assert simulated == pytest.approx(expected_moved_experts(experts, top_k, batch, cached), rel=0.03)
    # the cache does count: ignoring it would be off by the hit rate
    assert simulated < 0.95 * expected_moved_experts(experts, top_k, batch, 0) or cached / experts < 0.05


def test_release_on_one_h200_with_host_memory_says_what_fits_and_the_bounds(capsys):
    from kimik3.memory import H2D_BANDWIDTH_ASSUMED, PIECEWISE_LAYER_S_ASSUMED, expected_moved_experts

    base = ["memory", "--plan", "--gpus", "1", "--gpu-mem", "141GB", "--experts-offload", "host", "--context",
            "128K"]
    assert main([*base, "--host-mem", "1500GB", "--prefill-chunk", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["host"]["fits"] and plan["host"]["experts"] == 1_446_456_066_048 and plan["fits"]
    assert plan["gpu"]["experts_cache"] == plan["gpu"]["experts_cache"] + plan["gpu"]["left"]  # default: all left
    moved = 92 * expected_moved_experts(896, 16, 1, plan["cached_per_layer"]) * 17_547_264
    assert plan["decode"]["moved_bytes"] == pytest.approx(moved)
    # beside the experts, the GPU's HBM read and the piecewise-captured loop's reads of the routes (92 MoE layers at
    # the assumed cost of each)
    pieces = 92 * PIECEWISE_LAYER_S_ASSUMED
    assert plan["decode"]["piecewise_ms"] == pytest.approx(pieces * 1e3)
    gpu = plan["decode"]["gpu_bytes"] / 4.8e12
    assert plan["decode"]["step_ms"] == pytest.approx((moved / H2D_BANDWIDTH_ASSUMED + gpu + pieces) * 1e3)
    # a prefill chunk of C tokens moves each layer's distinct chosen experts once: at 8K all 896 (less the cached)
    assert main([*base, "--host-mem", "1000GB", "--batch", "8", "--experts-cache", "5GB", "--h2d-bandwidth",
                 "25GB/s"]) == 0
    out = capsys.readouterr().out
    assert "host memory: routed experts 1,446.46 GB of 1,000.00 GB: DOES NOT FIT (446.46 GB over)" in out
    assert "25.0 GB/s host->device + " in out and "host->device (ASSUMED" not in out
    assert "expert cache: 3 of 896 experts per MoE layer" in out
    # nothing fits beside that cache at batch 8: no chunk is recommended (the balanced one would be 65,536)
    assert "recommended prefill chunk: none (the largest whose workspace fits beside the expert cache: none" in out
    assert "verdict: DOES NOT FIT" in out


def test_the_plan_recommends_one_prefill_chunk_that_fits(capsys):
    """One recommendation: the balanced chunk when it fits, else the largest that fits, said once (before, 131,072
    was recommended two lines above '2,048 is the largest that fits')."""
    base = ["memory", "--plan", "--gpus", "1", "--gpu-mem", "141GB", "--experts-offload", "host", "--host-mem",
            "1500GB", "--context", "128K", "--prefill-chunk", "1024"]
    assert main([*base, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["recommended_chunk"] == plan["largest_fitting_chunk"] == 1024
    assert plan["recommended_why"] == "largest fitting" and plan["fits"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert out.count("recommended prefill chunk") == 1 and "largest prefill chunk" not in out
    assert "recommended prefill chunk: 1,024 tokens, the largest whose workspace fits beside the expert cache" in out
    # the GPU line says what it keeps back for the CUDA context and the allocator
    assert "reserved 3.82 GB (CUDA context 1.00 GB + allocator 2% of the GPU, ASSUMED)" in out


def test_host_compute_plan_weighs_the_cpu_against_the_copy(capsys):
    from kimik3.memory import (
        HOST_ROUTE_S_ASSUMED,
        PIECEWISE_LAYER_S_ASSUMED,
        STREAM_LAYER_S_ASSUMED,
        expected_moved_experts,
    )

    base = ["memory", "--plan", "--gpus", "1", "--gpu-mem", "141GB", "--experts-offload", "host", "--host-mem",
            "1500GB", "--context", "128K", "--prefill-chunk", "1024", "--json"]
    plans = {}
    for where in ("device", "host", "auto"):
        assert main([*base, "--experts-compute", where]) == 0
        plans[where] = json.loads(capsys.readouterr().out)
    host, device, auto = plans["host"], plans["device"], plans["auto"]
    cached = host["cached_per_layer"]
    lacking = expected_moved_experts(896, 16, 1, cached)
    routes = 16 * (1 - cached / 896)
    kernel = max(lacking * 17_547_264 / 100e9, routes * 6 * 3072 * 3584 / 2e12) + routes * 4 * 3584 / 50e9
    # decode computes its routes in the stream's order: the stream's own cost beyond the kernel, no read of the
    # routes, so no piecewise loop
    layer = kernel + STREAM_LAYER_S_ASSUMED
    assert host["decode"]["layer_host_ms"] == pytest.approx(layer * 1e3) and host["decode"]["streamed"]
    assert host["decode"]["step_ms"] == pytest.approx((92 * layer + host["decode"]["gpu_bytes"] / 4.8e12) * 1e3)
    assert host["decode"]["moved_bytes"] == 0 and host["decode"]["where"] == "host"
    # copied, the routes are read: each MoE layer pays its read in the piecewise loop
    assert not device["decode"]["streamed"] and device["decode"]["piecewise_ms"] == pytest.approx(
        92 * PIECEWISE_LAYER_S_ASSUMED * 1e3)
    # a prefill chunk (past STREAM_MAX_TOKENS) reads its routes: the route's own cost instead
    chunk_lacking = expected_moved_experts(896, 16, 1024, cached)
    chunk_routes = 1024 * 16 * (1 - cached / 896)
    chunk_layer = max(chunk_lacking * 17_547_264 / 100e9, chunk_routes * 6 * 3072 * 3584 / 2e12) \
        + chunk_routes * 4 * 3584 / 50e9 + HOST_ROUTE_S_ASSUMED
    assert host["prefill"]["transfer_s"] == pytest.approx(92 * chunk_layer)
    # at the assumed rates (the CPU's 100 GB/s against PCIe's 50) the CPU is faster at decode, the copy at prefill
    assert auto["decode"]["step_ms"] == host["decode"]["step_ms"] < device["decode"]["step_ms"]
    assert auto["prefill"]["where"] == "device" and host["prefill"]["where"] == "host"
    assert auto["prefill"]["bound_s"] == pytest.approx(min(host["prefill"]["bound_s"], device["prefill"]["bound_s"]))
    # "auto" weighs the piecewise read the copy pays in the decode loop: a host whose kernel is slower than the copy
    # by less than a read still streams (5.74 against 5.07 ms a layer at 94 GB/s: 0.67 ms < 1.5), by more it copies
    picks = {}
    for bandwidth in ("94GB/s", "80GB/s"):
        assert main([*base, "--experts-compute", "auto", "--host-bandwidth", bandwidth, "--h2d-bandwidth",
                     "55.3GB/s"]) == 0
        picks[bandwidth] = json.loads(capsys.readouterr().out)["decode"]
    assert picks["94GB/s"]["layer_copy_ms"] < picks["94GB/s"]["layer_host_ms"] < \
        picks["94GB/s"]["layer_copy_ms"] + PIECEWISE_LAYER_S_ASSUMED * 1e3 < picks["80GB/s"]["layer_host_ms"]
    assert picks["94GB/s"]["where"] == "host" and picks["80GB/s"]["where"] == "device"
    # the disk tier streams its decode routes too (the host step reads the mapped bytes): with the page cache
    # holding every expert it is the host tier's step; paged from the disk, each byte also pays the disk's read
    disk_base = [*base[:base.index("--experts-offload") + 1], "disk", *base[base.index("--host-mem"):]]
    assert main([*disk_base, "--experts-compute", "host"]) == 0
    cached_disk = json.loads(capsys.readouterr().out)
    assert cached_disk["decode"]["streamed"] and cached_disk["host"]["from_disk"] == 0
    assert cached_disk["decode"]["step_ms"] == pytest.approx(host["decode"]["step_ms"])
    paged = [*disk_base[:disk_base.index("--host-mem")], *disk_base[disk_base.index("--host-mem") + 2:]]
    assert main([*paged, "--experts-compute", "host"]) == 0
    from_disk = json.loads(capsys.readouterr().out)
    assert from_disk["decode"]["streamed"] and from_disk["host"]["from_disk"] == 1
    disk_kernel = max(lacking * 17_547_264 * (1 / 100e9 + 1 / 7e9), routes * 6 * 3072 * 3584 / 2e12) \
        + routes * 4 * 3584 / 50e9
    assert from_disk["decode"]["layer_host_ms"] == pytest.approx((disk_kernel + STREAM_LAYER_S_ASSUMED) * 1e3)


def test_measure_times_this_machine_and_plans_with_it(capsys, monkeypatch):
    import functools

    import kimik3.memory

    # at K3's widths, fewer experts and a smaller buffer than a real --measure (seconds, not a suite's share)
    monkeypatch.setattr(kimik3.memory, "measure_rates", functools.partial(
        kimik3.memory.measure_rates, experts=2, tokens=4, repeats=1, buffer_bytes=2**26))
    base = ["memory", "--plan", "--gpus", "1", "--gpu-mem", "141GB", "--experts-offload", "host", "--host-mem",
            "1500GB", "--context", "128K", "--experts-compute", "auto", "--measure"]
    assert main([*base, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    measured = plan["measured"]
    assert measured["dram_read_bytes_per_s"] > 1e9 and measured["host_bytes_per_s"] > 1e8
    assert plan["host_bytes_per_s"] == measured["host_bytes_per_s"] and plan["host_flops"] == measured["host_flops"]
    assert measured["bytes_per_expert"] == plan["bytes_per_expert"] == 17_547_264
    assert measured["host_kernel"].startswith("kernel ")  # the CPU kernel built here (the suite's machines have gcc)
    # for another host: the kernel at the fraction of DRAM read measured here, times that host's bandwidth
    assert main([*base, "--host-bandwidth", "300GB/s", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    target = plan["measured"]["for_host_bandwidth"]
    assert target["fraction_measured"] and plan["host_bytes_per_s"] == pytest.approx(target["kernel_fraction"] * 3e11)


def test_a_plan_for_another_hosts_dram_says_what_it_assumes(capsys):
    from kimik3.memory import HOST_KERNEL_FRACTION_ASSUMED

    base = ["memory", "--plan", "--gpus", "1", "--gpu-mem", "141GB", "--experts-offload", "host", "--host-mem",
            "1500GB", "--context", "128K", "--prefill-chunk", "1024", "--experts-compute", "auto"]
    rates = {}
    for bandwidth in ("200GB/s", "400GB/s"):
        assert main([*base, "--host-bandwidth", bandwidth, "--json"]) == 0
        rates[bandwidth] = json.loads(capsys.readouterr().out)
    assert rates["200GB/s"]["host_bytes_per_s"] == pytest.approx(HOST_KERNEL_FRACTION_ASSUMED * 2e11)
    # twice the DRAM: the CPU's share of a decode step halves
    slow, fast = rates["200GB/s"]["decode"], rates["400GB/s"]["decode"]
    assert fast["layer_host_ms"] < slow["layer_host_ms"] and fast["step_ms"] < slow["step_ms"]
    assert main([*base, "--host-bandwidth", "300GB/s"]) == 0
    assert ("for a host reading 300 GB/s from DRAM, ASSUMED: the kernel at 53% of it, the fraction "
            "docs/benchmarks.md records") in capsys.readouterr().out


def test_the_plan_counts_the_reads_of_the_routes_the_stream_and_the_cpu_route_and_takes_yours(capsys):
    """Copied experts: the decode step is captured between the host's reads of each MoE layer's routes, and each read
    costs the step time with the GPU idle. Computed on the CPU: decode streams its routes (no read, the step whole)
    and pays the stream's cost a MoE layer; a prefill chunk reads them and pays the route's own cost. Each is stated
    as assumed until given."""
    base = ["memory", "--plan", "--gpus", "1", "--gpu-mem", "141GB", "--experts-offload", "host", "--host-mem",
            "1500GB", "--context", "128K", "--prefill-chunk", "1024"]
    plans = {}
    given_ms = ["--piecewise-layer-ms", "0.5", "--host-route-ms", "0.25", "--stream-layer-ms", "0.05"]
    for name, extra in (("assumed", []), ("given", given_ms),
                        ("none", ["--piecewise-layer-ms", "0", "--host-route-ms", "0", "--stream-layer-ms", "0"])):
        for compute in ("host", "device"):
            assert main([*base, "--experts-compute", compute, *extra, "--json"]) == 0
            plans[name, compute] = json.loads(capsys.readouterr().out)
    given = plans["given", "host"]
    assert (given["piecewise_layer_s"], given["host_route_s"], given["stream_layer_s"]) == (0.5e-3, 0.25e-3, 0.05e-3)
    host = {name: plans[name, "host"]["decode"] for name in ("assumed", "given", "none")}
    copied = {name: plans[name, "device"]["decode"] for name in ("assumed", "given", "none")}
    # computed on the CPU: the stream's cost a layer, nothing for reads (the step is captured whole)
    assert host["given"]["piecewise_ms"] == host["none"]["piecewise_ms"] == 0
    assert host["given"]["layer_host_ms"] - host["none"]["layer_host_ms"] == pytest.approx(0.05)
    assert host["given"]["step_ms"] - host["none"]["step_ms"] == pytest.approx(92 * 0.05)
    assert host["none"]["step_ms"] == pytest.approx(92 * host["none"]["layer_host_ms"] + host["none"]["gpu_ms"])
    # the prefill chunk's routes are read: the route's own cost a layer
    assert plans["given", "host"]["prefill"]["transfer_s"] - plans["none", "host"]["prefill"]["transfer_s"] == \
        pytest.approx(92 * 0.25e-3)
    # copied: each read in the piecewise loop
    assert copied["given"]["piecewise_ms"] == pytest.approx(92 * 0.5) and copied["none"]["piecewise_ms"] == 0
    assert copied["given"]["step_ms"] - copied["none"]["step_ms"] == pytest.approx(92 * 0.5)
    assert host["assumed"]["step_ms"] > host["given"]["step_ms"] > host["none"]["step_ms"]
    assert main([*base, "--experts-compute", "host"]) == 0
    out = capsys.readouterr().out
    assert ("(in the stream's order, no route read: the stream's own 0.104 ms included, ASSUMED: measured on an "
            "H100's host; --stream-layer-ms gives yours)") in out and "the loop captures the step whole" in out
    assert main([*base, "--experts-compute", "device"]) == 0
    out = capsys.readouterr().out
    assert ("the piecewise-captured loop's reads of the routes (92 MoE layers x 1.50 ms = 138.0 ms, ASSUMED: "
            "measured on an H100's host") in out
    assert main([*base, "--experts-compute", "device", *given_ms]) == 0
    out = capsys.readouterr().out
    assert "92 MoE layers x 0.50 ms = 46.0 ms)" in out and "the stream's own 0.050 ms included)" in out


@pytest.mark.parametrize("argv,message", [
    pytest.param(["--experts-cache", "130GB"], "argument --experts-cache: 130,000,000,000 bytes is more than the GPU "
                 "holds beside the other weights", id="memory-plan-offload-cache-bigger-than-gpu"),
    pytest.param(["--experts-cache", "1GB"], "argument --experts-cache: 1,000,000,000 bytes is less than one expert "
                 "per MoE layer (92 layers x 17,547,264 bytes", id="memory-plan-offload-cache-below-one-expert"),
    pytest.param(["--tp", "2"], "argument --tp: 2 with --experts-offload: the offload keeps the routed experts of one "
                 "GPU", id="memory-plan-offload-with-tp"),
    pytest.param(["--no-offload"], "argument --host-mem: only with --experts-offload",
                 id="memory-plan-host-mem-without-offload"),
    pytest.param(["--no-host-mem"], "argument --experts-offload: needs --host-mem",
                 id="memory-plan-offload-without-host-mem"),
    pytest.param(["--no-offload", "--no-host-mem", "--measure"], "argument --measure: only with --experts-offload",
                 id="memory-plan-measure-without-offload"),
    pytest.param(["--experts-compute", "gpu"], "argument --experts-compute: invalid choice: 'gpu'",
                 id="memory-plan-compute-unknown"),
    pytest.param(["--h2d-bandwidth", "50GBs"], "argument --h2d-bandwidth: '50GBs' is not a bandwidth",
                 id="memory-plan-offload-bandwidth-typo"),
    pytest.param(["--piecewise-layer-ms", "-1"], "argument --piecewise-layer-ms: '-1' is not a duration",
                 id="memory-plan-piecewise-layer-negative"),
    pytest.param(["--host-route-ms", "nan"], "argument --host-route-ms: 'nan' is not a duration",
                 id="memory-plan-host-route-not-a-number"),
    pytest.param(["--no-offload", "--no-host-mem", "--piecewise-layer-ms", "2"],
                 "argument --piecewise-layer-ms: only with --experts-offload",
                 id="memory-plan-piecewise-layer-without-offload"),
    pytest.param(["--stream-layer-ms", "inf"], "argument --stream-layer-ms: 'inf' is not a duration",
                 id="memory-plan-stream-layer-infinite"),
])
def test_offload_plan_bad_input_exits_2_naming_the_option(capsys, argv, message):
    argv = list(argv)
    base = ["memory", "--plan", "--gpus", "1", "--gpu-mem", "141GB"]
    base += [] if "--no-offload" in argv else ["--experts-offload", "host"]
    base += [] if "--no-host-mem" in argv else ["--host-mem", "1500GB"]
    argv = [a for a in argv if a not in ("--no-offload", "--no-host-mem")]
    assert main([*base, *argv]) == 2
    assert "kimik3 memory: error: " + message in capsys.readouterr().err


@pytest.mark.parametrize("make, message", [
    pytest.param("fifo", "is a FIFO, not a JSON file", id="memory-config-fifo"),
    pytest.param("deep", "nested too deeply to parse", id="memory-config-nested-100k-deep"),
])
def test_memory_config_that_cannot_be_read_is_refused_at_once(tmp_path, capsys, make, message):
    import os
    import time

    path = tmp_path / "config.json"
    if make == "fifo":
        os.mkfifo(path)  # opening it to read would wait for a writer forever
    else:
        path.write_text("[" * 100_000 + "]" * 100_000)
    start = time.monotonic()
    assert main(["memory", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"kimik3 memory: error: argument --config: {path}: cannot be read as JSON: {message}" in err, err
    assert time.monotonic() - start < 30

