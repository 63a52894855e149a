"""Peak memory of a conversion is bounded by the streaming chunk, not by the model: measured in a process of its own
with the kernel's peak-RSS counter (VmHWM, reset through /proc/self/clear_refs) on two synthetic checkpoints, the
larger one many times the bound."""

import json
import sys
from pathlib import Path

import pytest

import kimik3.convert as kc
from k3_test_utils import run_forked
from kimik3.convert import testing

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from convert_throughput import reset_peak, status_bytes  # noqa: E402  (the benchmark measures the same way)

CHUNK = 4 * 2**20
WIDE = {"hidden_size": 256, "moe_intermediate_size": 256, "routed_expert_hidden_size": 256,
        "intermediate_size": 256, "vocab_size": 1024}

def measure(small, large, out, chunk):
    """Both expert formats, each warmed up on the small checkpoint (imports, pools), then the small and the large one
    with the peak reset before each; run in a forked child (k3_test_utils.run_forked): a process of its own, which
    gives its parent's freed memory back before measuring."""
    result = {}
    for experts in ("dense", "mxfp4"):
        kc.convert(small, f"{out}/warm-{experts}", progress=False, chunk_bytes=chunk, experts_format=experts,
                   threads=1)
        for label, src in (("small", small), ("large", large)):
            assert reset_peak()
            base = status_bytes("VmRSS:")
            summary = kc.convert(src, f"{out}/{experts}-{label}", progress=False, chunk_bytes=chunk,
                                 experts_format=experts, threads=1)
            result.setdefault(experts, {})[label] = {"growth": status_bytes("VmHWM:") - base,
                                                     "bytes": summary["bytes"]}
    return result


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mem")
    for name, layers in (("small", 2), ("large", 10)):
        testing.write_release_checkpoint(root / name, num_layers=layers, num_experts=64, config_overrides=WIDE,
                                         vision=False, return_dense=False, seed=4)
    return root


@pytest.fixture(scope="module")
def measured_by_format(checkpoints, tmp_path_factory):
    """Both expert formats measured in one child process."""
    returncode, measured, error = run_forked(measure, str(checkpoints / "small"), str(checkpoints / "large"),
                                             str(tmp_path_factory.mktemp("converted")), CHUNK)
    assert returncode == 0 and measured is not None, error
    return measured


@pytest.mark.skipif(not reset_peak(), reason="needs Linux /proc/self/clear_refs to reset the peak RSS")
@pytest.mark.parametrize("experts", ["dense", "mxfp4"])
def test_peak_rss_does_not_grow_with_the_model(measured_by_format, tmp_path, experts):
    measured = measured_by_format[experts]
    small, large = measured["small"], measured["large"]
    largest_tensor = 64 * 2 * 256 * 256 * (2 if experts == "dense" else 1)  # the fused gate_up of one layer
    assert large["bytes"] > 6 * small["bytes"]
    # Both conversions stay under one fixed bound of a few chunks (two in flight + reads, plus allocator slack) that
    # does not depend on the model, far below the larger output. (A bound relative to the small run's own growth
    # failed under CPU load: the small run's peak is the noisier, smaller figure, not a bound.)
    slack = 8 * 2**20
    for label in ("small", "large"):
        assert measured[label]["growth"] < 4 * CHUNK + slack, measured
    assert large["bytes"] > 2 * (4 * CHUNK + slack), measured
    assert large["growth"] < large["bytes"] / 4, measured
    if experts == "dense":
        assert large["growth"] < 3 * largest_tensor, measured
    Path(tmp_path / "measured.json").write_text(json.dumps(measured))
