"""Small helpers shared by the tests (CPU, and the GPU tests in tests/gpu/)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def grouped_product_f64(xs, weight, group_ends):
    """Each group of expert-sorted rows (group e: rows group_ends[e-1]:group_ends[e]) times its expert transposed, in
    float64: the reference of the grouped matmuls."""
    starts = [0, *group_ends.tolist()[:-1]]
    return torch.cat([xs[a:b].double() @ weight[e].double().t() for e, (a, b) in enumerate(zip(starts, group_ends))])


class TopLevelOps(TorchDispatchMode):
    """Records the names of the ops called at the top level (not the ops inside them: the mode is off while one
    runs), e.g. which matmul a dispatch chose."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def cache_of(output):
    """The cache of a model output on transformers 5.17 (`past_key_values`) and 5.24+ (`cache`)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values



def run_forked(function, *args, timeout: float = 300):
    """`function(*args)` in a child forked from this process, which has torch, transformers and kimik3 imported
    already: a fresh interpreter spent most of its time importing them. The child's return value travels back as
    JSON (nothing is unpickled). Returns (exit code, value, error text): the exit code is -N when signal N ended the
    child, and the value is None when the child died without replying."""
    import ctypes
    import json
    import multiprocessing
    import traceback

    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def child():
        receive.close()
        torch.set_num_threads(1)  # a forked child cannot use the parent's OpenMP pool
        # memory this process freed but glibc kept goes back to the system: a measurement in the child must not be
        # served from the parent's leftovers
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's
        if trim is not None:
            trim(0)
        try:
            reply = {"value": function(*args), "error": ""}
        except BaseException:
            reply = {"value": None, "error": traceback.format_exc()}
        send.send_bytes(json.dumps(reply).encode())

    process = context.Process(target=child, daemon=True)
    process.start()
    send.close()
    reply = {"value": None, "error": "the child ended without a reply"}
    if receive.poll(timeout):
        try:
            reply = json.loads(receive.recv_bytes())
        except EOFError:  # it died first (a signal, os._exit)
            pass
    else:
        reply["error"] = f"no reply in {timeout} s"
        process.kill()
    process.join(30)
    receive.close()
    return process.exitcode, reply["value"], reply["error"]


class Recorder:
    """A streamer (transformers' put/end interface) that keeps every call: the tensors it was given, then "end"."""

    def __init__(self):
        self.calls = []

    def put(self, value):
        self.calls.append(value.clone())

    def end(self):
        self.calls.append("end")


def assert_same_streamer_calls(mine: Recorder, theirs: Recorder, count: int) -> None:
    """Both streamers got `count` calls, the same tensors (shapes and values) in the same order, then "end"."""
    assert len(mine.calls) == len(theirs.calls) == count
    for a, b in zip(mine.calls, theirs.calls):
        assert (isinstance(a, str) and a == b == "end") or (a.shape == b.shape and torch.equal(a, b))


def offloaded_copy(model, experts_per_layer: int):
    """A copy of `model` with its routed experts offloaded to host memory (offload_kimi_k3.offload_routed_experts)
    and a device cache of `experts_per_layer` experts per MoE layer, as `model.experts_cache`."""
    import copy

    from kimik3.modeling.modeling_kimi_k3 import KimiK3Experts
    from kimik3.modeling.offload_kimi_k3 import expert_bytes, offload_routed_experts

    copied = copy.deepcopy(model)
    experts = [module for module in copied.modules() if isinstance(module, KimiK3Experts)]
    one = expert_bytes(experts[0].stacks())
    copied.experts_cache = offload_routed_experts(experts, "host", experts_per_layer * one * len(experts))
    return copied


def refresh_adoption_fingerprints(adopted) -> None:
    """The adopted folder's record fingerprints retaken from its release as it is now. A test that damages a release
    after adopting it (adopt refuses what the load must also refuse) checks the load's own refusal of the damage,
    not the record's notice that the release changed (tests/test_adopt.py checks that)."""
    import json
    from pathlib import Path

    from kimik3.modeling.files_kimi_k3 import ADOPTION_RECORD_NAME, release_fingerprints

    path = Path(adopted) / ADOPTION_RECORD_NAME
    record = json.loads(path.read_text())
    record["fingerprints"] = release_fingerprints(record["release"], record["links"])
    path.write_text(json.dumps(record, indent=2, sort_keys=True))


def noise_image(seed: int, width: int = 140, height: int = 112):
    """A picture of random pixels: it moves a tiny random model's logits measurably, where a flat colour barely does."""
    from PIL import Image

    pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return Image.fromarray(pixels.numpy())


def data_url(picture) -> str:
    """`picture` as a `data:image/png;base64,...` URL, as an OpenAI client sends an image."""
    import base64
    import io

    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
