"""CPU tests of the fast-path dispatch (`dispatch_kimi_k3`: the `@fast_op` declarations in `FAST_OPS`,
`fast_or_reference`, the KDA layer's predicates) and of `kimik3.kernels`: the model never gets a fast twin for CPU
tensors (even when fla/Triton import), each declared constraint and the one switch work, the kernels are imported on
first need only, an incompatible `kimik3.kernels` falls back to the references with one warning, and the references
agree with independent formulas."""

import dataclasses
import importlib
import logging
import shutil
import sys
import types

import pytest
import torch

from k3_test_utils import TopLevelOps, grouped_product_f64
from kimik3.tiny import build_tiny_model
from kimik3.configuration import tiny_text_config_dict
from kimik3.modeling.configuration_kimi_k3 import KimiK3TextConfig
from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM

kernels = importlib.import_module("kimik3.kernels")
for _mechanism in kernels.MECHANISMS:  # each file registers its torch.ops.kimik3.* ops, which the tests call
    importlib.import_module(f"{kernels.__name__}.{_mechanism}")
ops = importlib.import_module("kimik3.modeling.ops_kimi_k3")
dispatch = importlib.import_module("kimik3.modeling.dispatch_kimi_k3")


class FakeCuda(torch.Tensor):
    """A CPU tensor that reports a CUDA device: exercises the positive paths of the rules on a CPU machine."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def fake_cuda(*shape, dtype=torch.float32, requires_grad=False):
    return torch.randn(*shape, dtype=dtype, requires_grad=requires_grad).as_subclass(FakeCuda)


@pytest.fixture
def fake_fast_ops(monkeypatch):
    """Pretend an installed kimik3.kernels loads every fast twin (as when fla and Triton import on a CPU box)."""
    twins = {name: (lambda *a, _n=name, **k: _n) for name in dispatch.FAST_OPS}
    monkeypatch.setattr(dispatch, "_KERNELS", types.SimpleNamespace(load=twins.get))
    monkeypatch.delenv(dispatch.REFERENCE_ONLY_ENV, raising=False)
    return twins


def is_reference(name, fn):
    return fn is dispatch.FAST_OPS[name].reference


def test_every_declared_op_has_a_loader_and_the_model_asks_for_them():
    """One table on each side, the same names; each phase of a tiny model (prefill, chunked prefill continuing a
    cache, one-token decode; bf16-stored and MXFP4-packed experts) asks for exactly the ops of its mechanism, and
    every op but mxfp4_dequant (kept for the benchmark, which measures it) is asked for by one of them."""
    assert set(dispatch.FAST_OPS) == set(kernels.OP_NAMES)
    for name, op in dispatch.FAST_OPS.items():
        assert callable(op.reference) and op.reference.__module__ == ops.__name__, name

    asked = []

    class Recording(dict):
        def __getitem__(self, name):
            asked.append(name)
            return super().__getitem__(name)

    def asked_by(step):
        asked.clear()
        out = step()
        # off CUDA the fused AttnRes op runs its reference, which asks for its parts (the paths the model takes where
        # the fused twin may not run: autograd, torch.compile)
        order = [name for i, name in enumerate(asked) if i == 0 or name != asked[i - 1]]  # one ask reads it twice
        fused = [i for i, name in enumerate(order) if name == "attn_res_mix_norm"]
        assert fused and all(order[i + 1:i + 3] == ["block_attn_res_mix", "rms_norm"] for i in fused), order
        return set(asked), out

    every_layer = {"attn_res_mix_norm", "block_attn_res_mix", "causal_conv1d", "situ_glu", "router_logits",
                   "moe_experts", "rms_norm", "gated_rms_norm"}
    # a fresh prefill attends through the attention interface (whose SDPA asks for cuDNN first where
    # attention_with_lse's cuDNN twin may run: `sdpa_backend_order` reads that declaration); continuing a cache
    # merges key blocks by their LSE; one token steps the KDA recurrence (its decay from kda_gate: the chunked form
    # computes it inside chunk_kda) and attends in the absorbed latent form
    expected = {"prefill": every_layer | {"chunk_kda", "attention_with_lse"},
                "chunked prefill": every_layer | {"chunk_kda", "attention_with_lse"},
                "decode": every_layer | {"fused_recurrent_kda", "kda_gate", "mla_decode"}}
    ids = torch.randint(3, 128, (1, 9))
    seen = set()
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(dispatch, "FAST_OPS", Recording(dispatch.FAST_OPS))
        packed = KimiK3ForCausalLM(KimiK3TextConfig(**tiny_text_config_dict(num_hidden_layers=4),
                                                     experts_format="mxfp4"))
        for model, experts in ((build_tiny_model(num_hidden_layers=4), set()), (packed, {"moe_experts_mxfp4"})):
            prefill, out = asked_by(lambda: model(ids[:, :4], use_cache=True))
            cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
            chunked, _ = asked_by(lambda: model(ids[:, 4:8], cache=cache))
            decode, _ = asked_by(lambda: model(ids[:, 8:], cache=cache))
            phases = {"prefill": prefill, "chunked prefill": chunked, "decode": decode}
            assert phases == {phase: ops_ | experts for phase, ops_ in expected.items()}, experts
            seen |= prefill | chunked | decode
    assert seen == set(dispatch.FAST_OPS) - {"mxfp4_dequant"}


def test_cpu_tensors_never_get_a_fast_twin(fake_fast_ops):
    x = torch.randn(2, 3, dtype=torch.bfloat16)
    for name in dispatch.FAST_OPS:
        assert is_reference(name, dispatch.fast_or_reference(name, x))
        assert is_reference(name, dispatch.fast_or_reference(name, x, None, x))
        assert not dispatch.fast_path_allowed(name, x)
    meta = torch.empty(2, 3, device="meta")
    assert is_reference("situ_glu", dispatch.fast_or_reference("situ_glu", meta))


def test_no_tensor_and_unknown_names(fake_fast_ops):
    assert is_reference("situ_glu", dispatch.fast_or_reference("situ_glu"))
    assert is_reference("situ_glu", dispatch.fast_or_reference("situ_glu", None))
    with pytest.raises(KeyError):
        dispatch.fast_or_reference("no_such_op", fake_cuda(1))
    # an older install asked for an op it lacks: None, and the model keeps its reference
    assert kernels.load("no_such_op") is None


def test_each_declared_constraint(fake_fast_ops, monkeypatch):
    """With the device test satisfied the twin is returned, except where a declared constraint says otherwise."""
    x = fake_cuda(2, 3)
    assert dispatch.fast_or_reference("situ_glu", x)() == "situ_glu"
    assert is_reference("situ_glu", dispatch.fast_or_reference("situ_glu", x, torch.randn(2)))  # one real CPU tensor
    # forward_only: the reference while autograd records
    y = fake_cuda(2, 3, requires_grad=True)
    assert is_reference("fused_recurrent_kda", dispatch.fast_or_reference("fused_recurrent_kda", y))
    assert is_reference("attention_with_lse", dispatch.fast_or_reference("attention_with_lse", y.bfloat16()))
    with torch.no_grad():
        assert dispatch.fast_or_reference("fused_recurrent_kda", y)() == "fused_recurrent_kda"
    assert dispatch.fast_or_reference("chunk_kda", y.bfloat16())() == "chunk_kda"  # has a backward
    # tf32_dots (chunk_kda: fla's chunk kernel): fp32 keeps the reference at PyTorch's default fp32 matmul precision
    # ("highest"), and takes the twin where the user allows TF32, as for PyTorch's own fp32 GEMMs
    assert torch.get_float32_matmul_precision() == "highest"
    assert is_reference("chunk_kda", dispatch.fast_or_reference("chunk_kda", x))
    assert is_reference("chunk_kda", dispatch.fast_or_reference("chunk_kda", b16 := x.bfloat16(), x))  # any fp32
    for precision in ("high", "medium"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch, "get_float32_matmul_precision", lambda p=precision: p)
            assert dispatch.fast_or_reference("chunk_kda", x)() == "chunk_kda", precision
    assert dispatch.fast_or_reference("chunk_kda", b16)() == "chunk_kda"
    assert dispatch.fast_or_reference("fused_recurrent_kda", x)() == "fused_recurrent_kda"  # not declared so
    # half_only: f32 keeps the reference, bf16/fp16 take the twin
    for name in ("attention_with_lse", "moe_experts", "moe_experts_mxfp4"):
        assert is_reference(name, dispatch.fast_or_reference(name, x)), name
        assert dispatch.fast_or_reference(name, fake_cuda(2, 3, dtype=torch.bfloat16))() == name
        assert dispatch.fast_or_reference(name, fake_cuda(2, 3, dtype=torch.float16))() == name
    assert dispatch.fast_or_reference("mla_decode", x)() == "mla_decode"  # f32 is fine there
    assert is_reference("mla_decode", dispatch.fast_or_reference("mla_decode", y, x))  # forward only
    # rms_norm: bf16/fp16 with a weight of the same dtype and no autograd (eager prefill and decode)
    h = fake_cuda(2, 3, dtype=torch.bfloat16)
    assert dispatch.fast_or_reference("rms_norm", h, fake_cuda(3, dtype=torch.bfloat16))() == "rms_norm"
    assert is_reference("rms_norm", dispatch.fast_or_reference("rms_norm", h, fake_cuda(3)))  # f32 weight promotes
    assert is_reference("rms_norm", dispatch.fast_or_reference("rms_norm", x, fake_cuda(3)))
    trained_bf16, bf16_weight = y.bfloat16(), fake_cuda(3, dtype=torch.bfloat16)
    assert is_reference("rms_norm", dispatch.fast_or_reference("rms_norm", trained_bf16, bf16_weight))
    # gated_rms_norm: any float dtypes (bf16 rows and gate, the f32 weight), no autograd
    assert dispatch.fast_or_reference("gated_rms_norm", h, h, fake_cuda(3))() == "gated_rms_norm"
    trained_weight = fake_cuda(3, requires_grad=True)
    assert is_reference("gated_rms_norm", dispatch.fast_or_reference("gated_rms_norm", h, h, trained_weight))
    assert dispatch.fast_or_reference("kda_gate", h, fake_cuda(3), fake_cuda(3))() == "kda_gate"
    assert is_reference("kda_gate", dispatch.fast_or_reference("kda_gate", h, trained_weight, fake_cuda(3)))
    # one_dtype: AttnRes candidates of mixed dtypes keep the reference
    b = fake_cuda(2, 3, dtype=torch.bfloat16)
    assert dispatch.fast_or_reference("block_attn_res_mix", b, b)() == "block_attn_res_mix"
    assert is_reference("block_attn_res_mix", dispatch.fast_or_reference("block_attn_res_mix", b, x))
    # attn_res_mix_norm: 16-bit rows and weights all of one dtype (an f32 weight is legal for the module: the
    # reference), no autograd; the model asks with every tensor it reads, None for a missing prefix or delta
    w, proj = fake_cuda(3, dtype=torch.bfloat16), fake_cuda(1, 3, dtype=torch.bfloat16)
    assert dispatch.fast_or_reference("attn_res_mix_norm", b, b, None, w, proj, w)() == "attn_res_mix_norm"
    assert dispatch.fast_or_reference("attn_res_mix_norm", None, b, w, proj, w)() == "attn_res_mix_norm"
    for args in ((b, b, None, w, proj, fake_cuda(3)), (x, x, None, fake_cuda(3), fake_cuda(1, 3), fake_cuda(3)),
                 (b, b, b, w, proj, torch.randn(3, dtype=torch.bfloat16)),
                 (b, b, b, w, fake_cuda(1, 3, dtype=torch.bfloat16, requires_grad=True), w)):
        assert is_reference("attn_res_mix_norm", dispatch.fast_or_reference("attn_res_mix_norm", *args))
    # under torch.compile: the grouped-GEMM experts (torch ops) stay fast with or without autograd; the twins made of
    # custom ops (the compiled decode step's kernels) only while no gradient is recorded; the others never
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for name, op in dispatch.FAST_OPS.items():
        with torch.no_grad():
            fn = dispatch.fast_or_reference(name, b)
            assert (fn() == name) if op.traceable or op.traceable_forward else is_reference(name, fn), name
        with torch.enable_grad():
            fn = dispatch.fast_or_reference(name, b)
            assert (fn() == name) if op.traceable else is_reference(name, fn), name
    assert [name for name, op in dispatch.FAST_OPS.items() if op.traceable] == ["moe_experts"]
    assert {name for name, op in dispatch.FAST_OPS.items() if op.traceable_forward} == {
        "fused_recurrent_kda", "causal_conv1d", "block_attn_res_mix", "situ_glu", "moe_experts_mxfp4", "mxfp4_dequant",
        "mla_decode"}


def test_one_switch_forces_references(fake_fast_ops, monkeypatch):
    x = fake_cuda(2, 3, dtype=torch.bfloat16)
    for value in ("1", "all", " ALL "):
        monkeypatch.setenv("KIMIK3_REFERENCE_ONLY", value)
        assert all(is_reference(name, dispatch.fast_or_reference(name, x)) for name in dispatch.FAST_OPS)
    monkeypatch.setenv("KIMIK3_REFERENCE_ONLY", "situ_glu, moe_experts")
    assert is_reference("situ_glu", dispatch.fast_or_reference("situ_glu", x))
    assert is_reference("moe_experts", dispatch.fast_or_reference("moe_experts", x))
    assert dispatch.fast_or_reference("chunk_kda", x)() == "chunk_kda"
    for value in ("0", ""):
        monkeypatch.setenv("KIMIK3_REFERENCE_ONLY", value)
        assert dispatch.fast_or_reference("situ_glu", x)() == "situ_glu"
    monkeypatch.setenv("KIMIK3_REFERENCE_ONLY", "situ_glu,moe_expert")
    with pytest.raises(ValueError, match=r"KIMIK3_REFERENCE_ONLY.*'moe_expert'"):
        dispatch.fast_or_reference("situ_glu", x)


def test_kernels_module_without_dependencies_keeps_the_reference(monkeypatch):
    """A twin whose dependencies do not import is None from `load`, with the reason in `available_ops`."""
    monkeypatch.setattr(kernels, "_cache", {})
    monkeypatch.setattr(kernels, "_errors", {})
    twins = importlib.import_module(kernels.__name__ + "._base").TWINS
    monkeypatch.setitem(twins, "situ_glu", dataclasses.replace(twins["situ_glu"], needs=("no_such_triton",)))
    monkeypatch.setattr(dispatch, "_KERNELS", kernels)
    monkeypatch.delenv(dispatch.REFERENCE_ONLY_ENV, raising=False)
    assert kernels.load("situ_glu") is None
    assert "no_such_triton" in kernels.available_ops()["situ_glu"]
    assert is_reference("situ_glu", dispatch.fast_or_reference("situ_glu", fake_cuda(2)))


def test_available_ops_reports_reasons():
    status = kernels.available_ops()
    assert set(status) == set(kernels.OP_NAMES)
    for name, value in status.items():
        assert value is True or isinstance(value, str), name


def test_each_twin_is_registered_once_by_its_mechanism_file():
    """OP_NAMES is what the mechanism files register next to their twins (no second table): each twin is defined in
    one of them, under its op's name, and registering a name twice is refused."""
    base = importlib.import_module(kernels.__name__ + "._base")
    files = {f"{kernels.__name__}.{mechanism}" for mechanism in kernels.MECHANISMS}
    assert kernels.OP_NAMES == tuple(base.TWINS) and len(set(kernels.OP_NAMES)) == len(kernels.OP_NAMES)
    for name, registered in base.TWINS.items():
        assert registered.fn.__module__ in files and registered.fn.__name__ == name, name
    with pytest.raises(ValueError, match="'situ_glu' is already registered"):
        base.twin("situ_glu")(lambda *args: None)
    assert base.TWINS["situ_glu"].fn.__module__ == kernels.__name__ + ".situ"


@pytest.mark.skipif(importlib.import_module("kimik3.kernels._base").HAS_TRITON, reason="Triton imports here")
def test_without_triton_the_kernels_import_and_refuse_to_launch():
    """Where Triton does not import, every mechanism file still imports and registers its custom ops (the stand-ins
    of `_base`), and launching a kernel raises ImportError instead of running anything."""
    situ = importlib.import_module(kernels.__name__ + ".situ")
    with pytest.raises(ImportError, match="Triton"):
        situ._situ_fwd(torch.randn(2, 4), torch.randn(2, 4), 4.0, None, torch.float32)
    with pytest.raises(ImportError, match="_situ_fwd_kernel needs Triton"):
        situ._situ_fwd_kernel[(1,)]
    assert "ModuleNotFoundError" in kernels.available_ops()["situ_glu"]


# ------------------------------------------------------------------------------------- remote code vs kimik3.kernels


def test_the_kernels_report_the_remote_codes_interface_version():
    # one definition: the installed package's dispatch module declares it, kimik3.kernels reads it from there
    assert isinstance(dispatch.KERNELS_API_VERSION, int)
    assert "KERNELS_API_VERSION" not in vars(kernels) and kernels.KERNELS_API_VERSION is dispatch.KERNELS_API_VERSION
    assert dispatch._import_kernels() is kernels  # the handshake of the installed code with itself
    with pytest.raises(AttributeError, match="no attribute 'NO_SUCH_NAME'"):
        kernels.NO_SUCH_NAME


def _fake_kernels(version):
    module = types.ModuleType("kimik3.kernels")
    module.KERNELS_API_VERSION = version
    module.load = lambda name: (lambda *a, **k: "fast")
    return module


def test_incompatible_or_broken_kernels_fall_back_with_one_warning(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "kimik3.kernels", _fake_kernels(dispatch.KERNELS_API_VERSION + 1))
    with caplog.at_level(logging.WARNING):
        assert dispatch._import_kernels() is None
    warnings = [r for r in caplog.records if "kimik3.kernels" in r.getMessage()]
    assert len(warnings) == 1 and "interface version" in warnings[0].getMessage()
    caplog.clear()
    del sys.modules["kimik3.kernels"].KERNELS_API_VERSION  # an install from before the versioned interface
    with caplog.at_level(logging.WARNING):
        assert dispatch._import_kernels() is None
    assert len(caplog.records) == 1
    caplog.clear()
    compatible = _fake_kernels(dispatch.KERNELS_API_VERSION)
    monkeypatch.setitem(sys.modules, "kimik3.kernels", compatible)
    with caplog.at_level(logging.WARNING):
        assert dispatch._import_kernels() is compatible
    assert not caplog.records
    monkeypatch.setitem(sys.modules, "kimik3.kernels", None)  # not installed: silent
    with caplog.at_level(logging.WARNING):
        assert dispatch._import_kernels() is None
    assert not caplog.records

    def broken_install(name):
        raise AttributeError("module 'triton' has no attribute 'jit'")

    monkeypatch.setattr(dispatch.importlib, "import_module", broken_install)
    with caplog.at_level(logging.WARNING):
        assert dispatch._import_kernels() is None
    assert len(caplog.records) == 1 and "AttributeError" in caplog.records[0].getMessage()


@pytest.fixture
def folder_code(tmp_path, monkeypatch):
    """`folder_code()`: the remote-code files copied flat into a folder and imported as transformers imports them
    (the kimik3.kernels the test put in sys.modules next to them); returns (its modeling module, its dispatch
    module). Its modules leave sys.modules at the end of the test."""
    folder = tmp_path / "k3_folder_code"
    folder.mkdir()
    for path in importlib.import_module("kimik3.modeling").__path__:
        for source in __import__("pathlib").Path(path).glob("*_kimi_k3.py"):
            shutil.copy(source, folder / source.name)
    (folder / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(dispatch.REFERENCE_ONLY_ENV, raising=False)

    def imported():
        modeling = importlib.import_module("k3_folder_code.modeling_kimi_k3")
        return modeling, sys.modules["k3_folder_code.dispatch_kimi_k3"]

    yield imported
    for name in [n for n in sys.modules if n == "k3_folder_code" or n.startswith("k3_folder_code.")]:
        del sys.modules[name]


def test_model_folder_code_with_incompatible_installed_kernels(folder_code, monkeypatch, caplog):
    """A model folder's copy of the remote code next to an installed kimik3.kernels of another interface version:
    nothing at import, one warning at the first call that may use a twin, and the references run even for CUDA."""
    monkeypatch.setitem(sys.modules, "kimik3.kernels", _fake_kernels(dispatch.KERNELS_API_VERSION + 1))
    with caplog.at_level(logging.WARNING):
        modeling, folder_dispatch = folder_code()
        assert folder_dispatch is not dispatch and folder_dispatch._KERNELS is folder_dispatch._NOT_IMPORTED
        assert not [r for r in caplog.records if "interface version" in r.getMessage()]
        x = fake_cuda(2, 3, dtype=torch.bfloat16)
        folder_ops = sys.modules["k3_folder_code.ops_kimi_k3"]
        for _ in range(2):
            assert folder_dispatch.fast_or_reference("situ_glu", x) is folder_ops.situ_glu
    assert folder_dispatch._KERNELS is None
    assert len([r for r in caplog.records if "interface version" in r.getMessage()]) == 1
    assert modeling.fast_or_reference is folder_dispatch.fast_or_reference


class _ObservedKernels(types.ModuleType):
    """A compatible kimik3.kernels that records the remote code's handshake (its read of the interface version) and
    every twin asked for."""

    def __init__(self):
        super().__init__("kimik3.kernels")
        self.asked = []

    def __getattr__(self, name):
        if name != "KERNELS_API_VERSION":
            raise AttributeError(name)
        self.asked.append("handshake")
        return dispatch.KERNELS_API_VERSION

    def load(self, name):
        self.asked.append(name)
        return lambda *a, **k: "fast"


def test_the_kernels_are_imported_on_first_need_only(folder_code, monkeypatch):
    """Importing the remote code, building a model and running it on CPU never touches kimik3.kernels (every CPU
    decision is the reference's, settled by the declarations); the first call that may use a twin imports it once."""
    observed = _ObservedKernels()
    monkeypatch.setitem(sys.modules, "kimik3.kernels", observed)
    modeling, folder_dispatch = folder_code()
    assert observed.asked == [] and folder_dispatch._KERNELS is folder_dispatch._NOT_IMPORTED
    config = sys.modules["k3_folder_code.configuration_kimi_k3"].KimiK3TextConfig(
        **tiny_text_config_dict(num_hidden_layers=4))
    with torch.no_grad():
        out = modeling.KimiK3ForCausalLM(config)(torch.randint(3, 128, (1, 5)), use_cache=True)
    assert out.logits.isfinite().all()
    assert observed.asked == [] and folder_dispatch._KERNELS is folder_dispatch._NOT_IMPORTED
    x = fake_cuda(2, 3, dtype=torch.bfloat16)
    assert folder_dispatch.fast_or_reference("situ_glu", x)() == "fast"
    assert folder_dispatch._KERNELS is observed and observed.asked[0] == "handshake"
    assert observed.asked[-1] == "situ_glu" and observed.asked.count("handshake") == 1
    asked = len(observed.asked)
    assert folder_dispatch.fast_or_reference("situ_glu", x)() == "fast"
    assert observed.asked[asked:] == ["situ_glu"]


# ---------------------------------------------------------------------------------------------- references


def _dense_moe(x, idx, w, gate_up, down, beta, linear_beta):
    inter = gate_up.shape[1] // 2
    expected = torch.zeros(x.shape[0], x.shape[1])
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            ex = int(idx[t, j])
            h = x[t : t + 1] @ gate_up[ex].t()
            act = ops.situ_glu(h[:, :inter], h[:, inter:], beta, linear_beta)
            expected[t] += w[t, j] * (act @ down[ex].t()).float()[0]
    return expected.to(x.dtype)


def _moe_case(n=11, k=3, e=6, width=64, inter=32):
    x = torch.randn(n, width, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(n)])
    w = torch.rand(n, k)
    gate_up = (torch.randn(e, 2 * inter, width) * 0.2).to(torch.bfloat16)
    down = (torch.randn(e, width, inter) * 0.2).to(torch.bfloat16)
    return x, idx, w, gate_up, down


def test_reference_moe_experts_matches_dense_per_token_loop():
    x, idx, w, gate_up, down = _moe_case()
    out = ops.moe_experts(x, idx, w, gate_up, down, 4.0, 25.0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, _dense_moe(x, idx, w, gate_up, down, 4.0, 25.0), rtol=1e-2, atol=1e-2)


def test_reference_moe_experts_mxfp4_is_the_experts_of_the_dequantised_weights():
    x, idx, w, gate_up, down = _moe_case()
    packed = [ops.quantize_mxfp4(t) for t in (gate_up, down)]
    out = ops.moe_experts_mxfp4(x, idx, w, *packed[0], *packed[1], 4.0, 25.0)
    dense = [ops.dequantize_mxfp4(p, s, torch.bfloat16) for p, s in packed]
    assert not torch.equal(dense[0], gate_up)  # the quantisation did change the weights
    torch.testing.assert_close(out, _dense_moe(x, idx, w, *dense, 4.0, 25.0), rtol=1e-2, atol=1e-2)


def test_grouped_mm_moe_matches_reference_on_cpu():
    """The fast MoE's routing/sort/offset/combine logic, run through torch's CPU grouped_mm when it exists."""
    moe = importlib.import_module(kernels.__name__ + ".moe")
    x, idx, w, gate_up, down = _moe_case(n=21, k=4, e=8)
    try:
        out = moe.moe_experts(x, idx, w, gate_up, down, 4.0, 25.0)
    except (RuntimeError, NotImplementedError, ImportError) as exc:
        pytest.skip(f"grouped_mm unavailable on this CPU torch: {exc}")
    torch.testing.assert_close(out, ops.moe_experts(x, idx, w, gate_up, down, 4.0, 25.0), rtol=0, atol=0)


def test_reference_mla_decode_matches_expanded_attention():
    batch, heads, seq_len, rank, rope, nope, vdim = 2, 3, 10, 16, 8, 12, 6
    c = torch.randn(batch, seq_len, rank)
    k_pe = torch.randn(batch, seq_len, rope)
    w_uk = torch.randn(heads, nope, rank) * 0.3
    w_uv = torch.randn(heads, vdim, rank) * 0.3
    q_nope, q_pe = torch.randn(batch, heads, 1, nope), torch.randn(batch, heads, 1, rope)
    scale = (nope + rope) ** -0.5
    # expanded: k = [W_UK c, k_pe], v = W_UV c
    k_full = torch.cat([torch.einsum("hnr,btr->bhtn", w_uk, c), k_pe[:, None].expand(-1, heads, -1, -1)], -1)
    v_full = torch.einsum("hvr,btr->bhtv", w_uv, c)
    q_full = torch.cat([q_nope, q_pe], -1)
    expected_probs = torch.softmax(q_full @ k_full.transpose(-1, -2) * scale, -1)
    q_lat = torch.cat([torch.einsum("bhsn,hnr->bhsr", q_nope, w_uk), q_pe], -1)
    latents = torch.cat([c, k_pe], -1)
    o_lat, probs = ops.mla_decode(q_lat, latents, scale, rank)
    torch.testing.assert_close(torch.einsum("bhsr,hvr->bhsv", o_lat, w_uv), expected_probs @ v_full,
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(probs, expected_probs, rtol=1e-5, atol=1e-6)
    # a mask hiding the tail equals the shorter cache
    keep = (torch.arange(seq_len) < torch.tensor([10, 4])[:, None])[:, None, None, :]
    o_masked, _ = ops.mla_decode(q_lat, latents, scale, rank, keep)
    torch.testing.assert_close(o_masked[1:], ops.mla_decode(q_lat[1:], latents[1:, :4], scale, rank)[0])
    # the fast twin is one custom op (its CPU implementation is this reference): no probabilities, masks taken; it
    # has no backward, and its declaration keeps it out while autograd records (the twin does not ask again)
    from kimik3.kernels.mla import mla_decode as fast_mla_decode

    fast_out, fast_probs = fast_mla_decode(q_lat, latents, scale, rank)
    assert fast_probs is None and torch.equal(fast_out, o_lat)
    assert torch.equal(fast_mla_decode(q_lat, latents, scale, rank, keep)[0], o_masked)
    assert dispatch.FAST_OPS["mla_decode"].forward_only
    # a mask that does not broadcast over [B, H, S, T] is refused by the CUDA implementation, naming its shape
    from kimik3.kernels.mla import mla_decode_cuda

    for bad in (keep[:, :, :, :9], keep[:1], keep.expand(batch, 2, 1, seq_len), keep[:, 0]):
        with pytest.raises(ValueError, match=r"attention mask \(.*\) does not broadcast to \[2, 3, 1, 10\]"):
            mla_decode_cuda(q_lat.detach(), latents, scale, rank, bad)


def test_reference_mxfp4_dequant_is_the_models():
    assert dispatch.FAST_OPS["mxfp4_dequant"].reference is ops.dequantize_mxfp4
    assert dispatch.FAST_OPS["moe_experts"].reference is ops.moe_experts


def test_flash_attention_with_lse_adapter_matches_reference_on_cpu_op():
    """The CUDA fast path's adapter logic (V padding, LSE shape), exercised with the CPU flavour of the same op."""
    from kimik3.kernels.mla import attention_with_lse as flash_lse

    q, k, v = torch.randn(2, 3, 6, 24), torch.randn(2, 3, 6, 24), torch.randn(2, 3, 6, 16)
    for causal in (False, True):
        out, lse = flash_lse(q, k, v, 0.2, causal)
        ref_out, ref_lse = ops.attention_with_lse(q, k, v, 0.2, causal)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    assert is_reference("attention_with_lse", dispatch.fast_or_reference("attention_with_lse", q))


def test_attention_with_lse_falls_back_to_flash_where_cudnn_refuses(monkeypatch):
    """cuDNN first on CUDA; where it raises for some (device, dtype, head dims), flash, and cuDNN is not asked again
    for those; other head dims still ask cuDNN."""
    mla = importlib.import_module(kernels.__name__ + ".mla")
    monkeypatch.setattr(mla, "_CUDNN_REFUSED", set())
    calls = []

    def cudnn(q, k, v, scale, causal):
        calls.append(("cudnn", q.shape[-1], v.shape[-1]))
        if q.shape[-1] == 24:
            raise RuntimeError("cuDNN Frontend error: no engine for these head dims")
        if q.shape[-2] == 5:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return "cudnn result"

    monkeypatch.setattr(mla, "_cudnn", cudnn)
    monkeypatch.setattr(mla, "_flash", lambda q, k, v, scale, causal: calls.append(("flash",)) or "flash")
    q, v = fake_cuda(1, 2, 4, 24, dtype=torch.bfloat16), fake_cuda(1, 2, 4, 16, dtype=torch.bfloat16)
    assert mla.attention_backend(q, v) == "cudnn"
    assert mla.attention_with_lse(q, q, v, 0.2, True) == "flash"
    assert calls == [("cudnn", 24, 16), ("flash",)]
    assert mla.attention_backend(q, v) == "flash"
    assert mla.attention_with_lse(q, q, v, 0.2, False) == "flash" and calls[-1] == ("flash",)
    assert len(calls) == 3  # no second cuDNN attempt
    q32 = fake_cuda(1, 2, 4, 32, dtype=torch.bfloat16)
    assert mla.attention_with_lse(q32, q32, v, 0.2, True) == "cudnn result"
    # out of memory is no refusal: it reaches the caller and cuDNN stays the choice
    long = fake_cuda(1, 2, 5, 32, dtype=torch.bfloat16)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        mla.attention_with_lse(long, long, v, 0.2, False)
    assert mla.attention_backend(q32, v) == "cudnn"
    assert mla.attention_backend(q.as_subclass(torch.Tensor), v) == "flash"  # off CUDA: the flash CPU op


# ------------------------------------------------------------------------ custom ops (torch.compile keeps the kernels)


_STEPS_KEPT = []  # the host steps the cases name (the kernels' registry holds them weakly)


def _kept(host, step) -> int:
    _STEPS_KEPT.append(step)
    return host.register_step(step)


def _custom_op_cases():
    """Inputs for every `torch.ops.kimik3.*` op: decode-step shapes, strided views where the model passes them."""
    registered = importlib.import_module(kernels.__name__ + "._base").CUSTOM_OPS
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(dtype)

    fused = randn(3, 2, 16, dtype=torch.bfloat16)  # a fused gate_up projection: SiTU reads its two halves
    packed, scale = ops.quantize_mxfp4(randn(4, 6, 64))
    step = [randn(2, 1, 3, 4), randn(2, 1, 3, 4), randn(2, 1, 3, 5), -torch.rand(2, 1, 3, 4, generator=gen),
            torch.rand(2, 1, 3, generator=gen)]
    cases = {
        "situ_glu": [(fused[..., :8], fused[..., 8:], 4.0, 25.0), (randn(5, 8), randn(5, 8), 1.0, None)],
        "block_attn_res_mix": [([randn(2, 1, 8) for _ in range(3)], randn(8), randn(1, 8), 1e-6)],
        "fused_recurrent_kda": [(*step, None, randn(2, 3, 4, 5), True, True), (*step, 0.3, None, False, False)],
        "causal_conv1d": [(randn(2, 1, 6), randn(6, 1, 4), randn(2, 6, 3)), (randn(2, 5, 6), randn(6, 1, 4), None)],
        "grouped_matmul_few_rows": [(randn(7, 64, dtype=torch.bfloat16), randn(4, 6, 64, dtype=torch.bfloat16),
                                     torch.tensor([2, 2, 5, 7], dtype=torch.int32)),
                                    (randn(4, 16), randn(3, 6, 16), torch.tensor([0, 1, 4], dtype=torch.int32))],
        "mxfp4_dequant": [(packed, scale, torch.bfloat16), (packed, scale, torch.float32)],
        "mxfp4_grouped_matmul": [(randn(7, 64, dtype=torch.bfloat16), packed, scale,
                                  torch.tensor([2, 2, 5, 7], dtype=torch.int32))],
        "mxfp4_grouped_gemm": [(randn(9, 64, dtype=torch.bfloat16), packed, scale,
                                torch.tensor([0, 4, 4, 9], dtype=torch.int32)),
                               (randn(3, 64), packed, scale, torch.tensor([3, 3, 3, 3], dtype=torch.int32))],
        "mla_decode": [(randn(2, 3, 1, 24, dtype=torch.bfloat16), randn(2, 5, 24, dtype=torch.bfloat16), 0.3, 16,
                        torch.arange(5) < torch.tensor([5, 2])[:, None, None, None]),
                       (randn(1, 2, 3, 12), randn(1, 4, 12), 0.5, 8, None)],
        "mxfp4_gemv": [(randn(4, 64, dtype=torch.bfloat16), packed, scale,
                        torch.tensor([0, 1, 3, 4], dtype=torch.int32)),
                       (randn(2, 64), packed, scale, torch.tensor([0, 0, 0, 2], dtype=torch.int32))],
    }
    # the host step's op (kimik3.kernels.mxfp4_host): one layer's routes on the CPU, the step registered by number
    host = importlib.import_module(kernels.__name__ + ".mxfp4_host")
    gate_up = ops.quantize_mxfp4(randn(5, 64, 64))
    table = host.ExpertTable(gate_up, ops.quantize_mxfp4(randn(5, 64, 32)), torch.zeros(5, dtype=torch.int64))
    cases["host_routes"] = [
        (randn(3, 64, dtype=dtype), torch.tensor([[0, 4], [4, 1], [2, 0]]),
         _kept(host, host.HostRouteStep(table, 3, 2, dtype, 4.0, 25.0, torch.device("cpu"))))
        for dtype in (torch.float32, torch.bfloat16)]
    assert set(cases) == set(registered)
    return cases


def test_every_custom_op_fake_impl_matches_its_real_output():
    """opcheck on CPU (the ops' CPU implementation is the reference): the schema, the fake implementation's shapes,
    dtypes and strides against the real outputs, and the op under AOT autograd with dynamic shapes."""
    for name, cases in _custom_op_cases().items():
        op = getattr(torch.ops.kimik3, name).default
        for i, args in enumerate(cases):
            utils = ("test_schema", "test_faketensor") + (("test_aot_dispatch_dynamic",) if i == 0 else ())
            result = torch.library.opcheck(op, args, test_utils=utils)
            assert result == {u: "SUCCESS" for u in utils}, (name, i, result)


def test_custom_ops_run_the_references_off_cuda():
    cases = _custom_op_cases()
    gate, up, beta, linear_beta = cases["situ_glu"][0]
    assert torch.equal(torch.ops.kimik3.situ_glu(gate, up, beta, linear_beta), ops.situ_glu(gate, up, beta, linear_beta))
    o, state = torch.ops.kimik3.fused_recurrent_kda(*cases["fused_recurrent_kda"][0])
    ref_o, ref_state = ops.fused_recurrent_kda(*cases["fused_recurrent_kda"][0])
    assert torch.equal(o, ref_o) and torch.equal(state, ref_state)
    assert torch.ops.kimik3.fused_recurrent_kda(*cases["fused_recurrent_kda"][1])[1].numel() == 0  # no state asked
    xs, packed, scale, ends = cases["mxfp4_grouped_matmul"][0]
    dense = ops.dequantize_mxfp4(packed, scale, torch.float32)
    rows = [xs[a:b].float() @ dense[e].t() for e, (a, b) in enumerate(zip([0, *ends.tolist()], ends.tolist()))]
    torch.testing.assert_close(torch.ops.kimik3.mxfp4_grouped_matmul(xs, packed, scale, ends),
                               torch.cat(rows).to(xs.dtype), rtol=0, atol=0)


def test_custom_ops_compile_into_one_graph_without_breaks(monkeypatch):
    """A decode-like step calling every custom op (and the experts' routing around the grouped matmuls, as
    kernels/moe.py and mxfp4.py run it: the packed experts' and, as on CUDA, the bf16 experts' few-rows one) compiles with
    fullgraph=True into one graph that keeps each op as a node, and computes what it computes eagerly."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    moe = importlib.import_module(kernels.__name__ + ".moe")
    monkeypatch.setattr(moe, "_few_rows_kernel_runs_on", lambda x: True)  # the CUDA decision, on CPU tensors
    mxfp4 = importlib.import_module(kernels.__name__ + ".mxfp4")
    cases = _custom_op_cases()
    x, idx, w, gate_up, down = _moe_case(n=1, k=3, e=4, width=64, inter=32)  # 3 rows, 4 experts: GEMV
    (gu_packed, gu_scale), (d_packed, d_scale) = ops.quantize_mxfp4(gate_up), ops.quantize_mxfp4(down)
    kda_args = cases["fused_recurrent_kda"][0]
    conv_x, conv_w, conv_state = cases["causal_conv1d"][0]
    mix_args = cases["block_attn_res_mix"][0]

    def step(x, idx, w):
        routed = moe._routed_experts(
            x, idx, w, 4, 32,
            lambda xs, offs: torch.ops.kimik3.mxfp4_grouped_matmul(xs, gu_packed, gu_scale, offs),
            lambda act, offs: torch.ops.kimik3.mxfp4_grouped_matmul(act, d_packed, d_scale, offs),
            4.0, 25.0)
        h = torch.ops.kimik3.situ_glu(routed, routed * 0.5, 4.0, None)
        o, state = torch.ops.kimik3.fused_recurrent_kda(*kda_args)
        y, new_conv = torch.ops.kimik3.causal_conv1d(conv_x, conv_w, conv_state)
        mixed = torch.ops.kimik3.block_attn_res_mix(*mix_args)
        attended = torch.ops.kimik3.mla_decode(*cases["mla_decode"][0])
        dense = torch.ops.kimik3.mxfp4_dequant(gu_packed, gu_scale, torch.bfloat16)
        packed = mxfp4.moe_experts_mxfp4(x, idx, w, gu_packed, gu_scale, d_packed, d_scale, 4.0, 25.0)  # GEMV size
        plain = moe.moe_experts(x, idx, w, gate_up, down, 4.0, 25.0)
        prefill = torch.ops.kimik3.mxfp4_grouped_gemm(*cases["mxfp4_grouped_gemm"][0])
        host = torch.ops.kimik3.host_routes(*cases["host_routes"][0])
        return routed, h, o, state, y, new_conv, mixed, attended, dense, prefill, packed, plain, host

    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        compiled = torch.compile(step, fullgraph=True, backend=recording_backend)(x, idx, w)
        eager = step(x, idx, w)
    assert len(graphs) == 1 and sum(counters["graph_break"].values()) == 0
    code = graphs[0].code
    for name in _custom_op_cases():
        assert f"torch.ops.kimik3.{name}" in code, name
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)
    # the packed experts' routing around the custom grouped matmul computes the reference packed experts
    reference = ops.moe_experts_mxfp4(x, idx, w, gu_packed, gu_scale, d_packed, d_scale, 4.0, 25.0)
    torch.testing.assert_close(compiled[0], reference, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(compiled[-3], reference, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(compiled[-2], ops.moe_experts(x, idx, w, gate_up, down, 4.0, 25.0), rtol=1e-2,
                               atol=1e-2)
    torch._dynamo.reset()


# ------------------------------------------------------------------ few-rows grouped matmul (bf16 experts at decode)


@pytest.mark.parametrize("counts", [[0, 1, 0, 3, 17], [1, 0, 0, 0, 0], [0, 0, 0, 0, 2], [5, 5, 5, 5, 5]])
def test_grouped_matmul_few_rows_reference_is_the_grouped_product(counts):
    """The op's CPU implementation (the reference of its Triton kernel): each group times its own expert, empty
    experts skipped, in f32 to float64 accuracy and in bf16 as grouped_mm rounds it (f32 accumulation, one rounding)."""
    ends = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    xs, weight = torch.randn(sum(counts), 80), torch.randn(5, 48, 80)
    out = torch.ops.kimik3.grouped_matmul_few_rows(xs, weight, ends)
    assert out.shape == (sum(counts), 48) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), grouped_product_f64(xs, weight, ends), rtol=1e-5, atol=1e-4)
    # a shuffled assignment of experts gives other numbers: the groups really pick their own expert
    wrong = torch.ops.kimik3.grouped_matmul_few_rows(xs, weight.flip(0), ends)
    assert not torch.allclose(wrong, out)
    xs16, weight16 = xs.bfloat16(), weight.bfloat16()
    out16 = torch.ops.kimik3.grouped_matmul_few_rows(xs16, weight16, ends)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.double(), grouped_product_f64(xs16, weight16, ends), rtol=8e-3, atol=1e-2)
    try:
        grouped = torch._grouped_mm(xs16, weight16.transpose(-2, -1), offs=ends)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"grouped_mm unavailable on this CPU torch: {exc}")
    assert torch.equal(out16, grouped)


def test_moe_experts_few_rows_decision():
    """The bf16 experts take the few-rows kernel exactly for CUDA tensors with Triton, no gradient recorded and at
    most FEW_ROWS_PER_EXPERT routed rows per expert on average (decode); grouped_mm otherwise."""
    moe = importlib.import_module(kernels.__name__ + ".moe")
    assert moe.FEW_ROWS_PER_EXPERT == 4
    # the benchmark model: 64 experts, top-16: 16 decoding tokens still qualify, 17 do not
    assert moe.few_rows_per_expert(1 * 16, 64) and moe.few_rows_per_expert(16 * 16, 64)
    assert not moe.few_rows_per_expert(17 * 16, 64)
    x = fake_cuda(2, 8, dtype=torch.bfloat16)
    gate_up, down = fake_cuda(64, 12, 8, dtype=torch.bfloat16), fake_cuda(64, 8, 6, dtype=torch.bfloat16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "HAS_TRITON", True)  # as where Triton imports
        assert moe._use_few_rows_kernel(x, gate_up, down, 32)
        assert not moe._use_few_rows_kernel(x, gate_up, down, 257)  # prefill
        assert not moe._use_few_rows_kernel(x.as_subclass(torch.Tensor), gate_up, down, 32)  # CPU
        trained = fake_cuda(64, 12, 8, dtype=torch.bfloat16, requires_grad=True)
        assert not moe._use_few_rows_kernel(x, trained, down, 32)  # autograd records: the op has no backward
        with torch.no_grad():
            assert moe._use_few_rows_kernel(x, trained, down, 32)
        sharded = fake_cuda(64, 12, 8, dtype=torch.bfloat16)
        sharded.to_local = lambda: gate_up  # as a tensor-parallel DTensor: grouped_mm keeps its sharding rules
        assert not moe._use_few_rows_kernel(x, sharded, down, 32)
        mp.setattr(moe, "HAS_TRITON", False)  # no Triton: the op would have no CUDA kernel
        assert not moe._use_few_rows_kernel(x, gate_up, down, 32)


def test_moe_experts_runs_the_few_rows_op_at_decode_and_grouped_mm_otherwise(monkeypatch):
    """With the device test passed (as on CUDA), `moe_experts` runs both matmuls as the custom op at decode sizes and
    through grouped_mm for prefill sizes or while autograd records; every path computes the reference experts."""
    moe = importlib.import_module(kernels.__name__ + ".moe")
    monkeypatch.setattr(moe, "_few_rows_kernel_runs_on", lambda x: True)
    few, grouped = "kimik3.grouped_matmul_few_rows", "aten._grouped_mm"
    cases = {"decode": (_moe_case(n=2, k=3, e=6), False, {few}),
             "prefill": (_moe_case(n=9, k=3, e=6), False, {grouped}),  # 27 routed rows > 4 x 6 experts
             "training": (_moe_case(n=2, k=3, e=6), True, {grouped})}
    for name, ((x, idx, w, gate_up, down), train, expected) in cases.items():
        if train:
            gate_up.requires_grad_(True)
        with TopLevelOps() as seen:
            try:
                out = moe.moe_experts(x, idx, w, gate_up, down, 4.0, 25.0)
            except (RuntimeError, NotImplementedError) as exc:
                pytest.skip(f"grouped_mm unavailable on this CPU torch: {exc}")
        assert seen.names & {few, grouped} == expected, name
        torch.testing.assert_close(out, ops.moe_experts(x, idx, w, gate_up, down, 4.0, 25.0), rtol=1e-2, atol=1e-2)


def test_sdpa_backend_order_asks_for_cudnn_only_for_cuda_inference_with_sdpa(monkeypatch):
    """The expanded MLA attention's SDPA runs with cuDNN first exactly on CUDA, with the "sdpa" implementation and no
    mask, no autograd recording through the query, outside torch.compile and unless attention_with_lse is forced to
    its reference; every other case gets no context at all (SDPA's own choice)."""
    import contextlib

    monkeypatch.delenv(dispatch.REFERENCE_ONLY_ENV, raising=False)
    query = fake_cuda(1, 2, 4, 8, dtype=torch.bfloat16)

    def asks_cudnn(q, implementation="sdpa"):
        return not isinstance(dispatch.sdpa_backend_order(q, implementation), contextlib.nullcontext)

    assert asks_cudnn(query)
    assert isinstance(dispatch.sdpa_backend_order(query, "sdpa", masked=True), contextlib.nullcontext)  # padding
    assert not asks_cudnn(query, "eager") and not asks_cudnn(query, "flash_attention_2")
    assert not asks_cudnn(query.as_subclass(torch.Tensor))  # CPU
    trained = fake_cuda(1, 2, 4, 8, dtype=torch.bfloat16, requires_grad=True)
    assert not asks_cudnn(trained)
    with torch.no_grad():
        assert asks_cudnn(trained)
    monkeypatch.setenv(dispatch.REFERENCE_ONLY_ENV, "attention_with_lse")
    assert not asks_cudnn(query)
    monkeypatch.setenv(dispatch.REFERENCE_ONLY_ENV, "1")
    assert not asks_cudnn(query)
    monkeypatch.delenv(dispatch.REFERENCE_ONLY_ENV)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not asks_cudnn(query)


# --------------------------------------------------------------------- packed MXFP4 experts: GEMV, tiles, dequantised


@pytest.mark.parametrize("counts", [[0, 1, 0, 3, 2], [1, 0, 0, 0, 0], [0, 0, 0, 0, 2], [0, 0, 0, 0, 0]])
def test_mxfp4_gemv_reference_is_the_product_of_the_dequantised_experts(counts):
    """The GEMV op's CPU implementation (the reference of its Triton kernel, shared with the tile op): each group of
    rows times its own dequantised expert, empty experts skipped; f32 to float64 accuracy, bf16 rounded once."""
    ends = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    packed, scale = ops.quantize_mxfp4(torch.randn(5, 48, 96) * 0.05)
    scale[0, :2, 0] = torch.tensor([0, 200], dtype=torch.uint8)  # a denormal and a large group scale
    dense = ops.dequantize_mxfp4(packed, scale, torch.float32)
    xs = torch.randn(sum(counts), 96)
    out = torch.ops.kimik3.mxfp4_gemv(xs, packed, scale, ends)
    assert out.shape == (sum(counts), 48) and out.dtype == torch.float32
    expected = grouped_product_f64(xs, dense, ends) if sum(counts) else torch.zeros(0, 48, dtype=torch.float64)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(out, torch.ops.kimik3.mxfp4_grouped_matmul(xs, packed, scale, ends))
    if sum(counts):  # the groups really pick their own expert
        assert not torch.allclose(torch.ops.kimik3.mxfp4_gemv(xs, packed.flip(0), scale.flip(0), ends), out)
    out16 = torch.ops.kimik3.mxfp4_gemv(xs.bfloat16(), packed, scale, ends)
    assert out16.dtype == torch.bfloat16 and out16.shape == out.shape
    torch.testing.assert_close(out16.double(), expected if not sum(counts) else
                               grouped_product_f64(xs.bfloat16(), dense, ends), rtol=8e-3, atol=1e-2)


def test_packed_matmul_operands_refuse_a_k_of_part_of_a_scale_group():
    """The CUDA launchers' operand check refuses what the reference refuses: K = 48 (one and a half scale groups)
    with one scale a row, whose shapes agree with K // 32, and a scale count that does not match K; each error names
    the shapes. A whole number of groups passes."""
    mxfp4 = importlib.import_module(f"{kernels.__name__}.mxfp4")
    ends = torch.tensor([2, 3], dtype=torch.int32)
    packed, scale = torch.zeros(2, 8, 24, dtype=torch.uint8), torch.full((2, 8, 1), 127, dtype=torch.uint8)
    for bad_scale in (scale, torch.full((2, 8, 2), 127, dtype=torch.uint8)):
        with pytest.raises(ValueError, match=r"shapes do not match: x \(3, 48\), packed \(2, 8, 24\)"):
            mxfp4._mxfp4_matmul_operands(torch.zeros(3, 48), packed, bad_scale, ends)
        with pytest.raises(ValueError, match="MXFP4 shapes do not match"):  # the reference's own check
            ops.dequantize_mxfp4(packed, bad_scale)
    out = mxfp4._mxfp4_matmul_operands(torch.zeros(3, 64), torch.zeros(2, 8, 32, dtype=torch.uint8),
                                       torch.full((2, 8, 2), 127, dtype=torch.uint8), ends)[-1]
    assert out.shape == (3, 8)


def test_packed_words_are_the_bytes_as_little_endian_words_wherever_the_bytes_start():
    """The word kernels' operand: packed bytes as int32 words, a view where the bytes start on a word, a copy where
    they start off one (a slice one byte in), the same words either way."""
    mxfp4 = importlib.import_module(f"{kernels.__name__}.mxfp4")
    flat = torch.randint(0, 256, (1 + 2 * 3 * 16,), dtype=torch.uint8)
    for offset in (0, 1):
        packed = flat[offset:offset + 2 * 3 * 16].view(2, 3, 16)
        words = mxfp4._packed_words(packed)
        assert words.shape == (2, 3, 4) and words.dtype == torch.int32
        assert (words.data_ptr() == packed.data_ptr()) == (offset == 0)
        expected = sum(packed.view(2, 3, 4, 4)[..., i].long() << (8 * i) for i in range(4))
        assert torch.equal(words.long() & 0xFFFFFFFF, expected)


def test_mxfp4_experts_path_decision():
    """GEMV up to MXFP4_GEMV_ROWS_PER_EXPERT routed rows per expert on average, the tile kernel up to
    MXFP4_TILE_ROWS_PER_EXPERT, the packed grouped GEMM beyond."""
    mxfp4 = importlib.import_module(kernels.__name__ + ".mxfp4")
    assert (mxfp4.MXFP4_GEMV_ROWS_PER_EXPERT, mxfp4.MXFP4_TILE_ROWS_PER_EXPERT,
            mxfp4.MXFP4_GEMM_ROWS_PER_EXPERT) == (2, 16, 256)
    # the benchmark model: 64 experts, top-16: decode at batch 1..8 is GEMV, 9..64 tokens tiles, more dequantised
    assert mxfp4.mxfp4_experts_path(1 * 16, 64) == "gemv" and mxfp4.mxfp4_experts_path(8 * 16, 64) == "gemv"
    assert mxfp4.mxfp4_experts_path(9 * 16, 64) == "tiles" and mxfp4.mxfp4_experts_path(16 * 16, 64) == "tiles"
    assert mxfp4.mxfp4_experts_path(64 * 16, 64) == "tiles"
    assert mxfp4.mxfp4_experts_path(65 * 16, 64) == "gemm" and mxfp4.mxfp4_experts_path(256 * 64, 64) == "gemm"
    assert mxfp4.mxfp4_experts_path(256 * 64 + 1, 64) == "dequantised"
    # the release: 896 experts, an 8K prefill (~146 rows per expert) on the packed GEMM, 32K (~585) dequantised
    assert mxfp4.mxfp4_experts_path(8192 * 16, 896) == "gemm"
    assert mxfp4.mxfp4_experts_path(32768 * 16, 896) == "dequantised"
    assert mxfp4.mxfp4_experts_path(0, 64) == "gemv"
    # beside the word tiles (bf16 on Hopper) the GEMV stops at 1 row per expert: 8 tokens over 64 experts go to them
    assert mxfp4.MXFP4_GEMV_ROWS_PER_EXPERT_BESIDE_WORD_TILES == 1
    assert mxfp4.mxfp4_experts_path(4 * 16, 64, word_tiles=True) == "gemv"
    assert mxfp4.mxfp4_experts_path(4 * 16 + 1, 64, word_tiles=True) == "tiles"
    assert mxfp4.mxfp4_experts_path(8 * 16, 64, word_tiles=True) == "tiles"
    assert mxfp4.mxfp4_experts_path(65 * 16, 64, word_tiles=True) == "gemm"
    with pytest.MonkeyPatch.context() as mp:  # the constants are the switch the benchmark flips
        mp.setattr(mxfp4, "MXFP4_GEMV_ROWS_PER_EXPERT", 0)
        assert mxfp4.mxfp4_experts_path(16, 64) == "tiles"
        assert mxfp4.mxfp4_experts_path(16, 64, word_tiles=True) == "tiles"


def test_moe_experts_mxfp4_runs_each_path_by_rows_per_expert():
    """`moe_experts_mxfp4` (without autograd its Triton entry points are custom ops) runs the GEMV op at decode sizes,
    the tile op at a few rows per expert and the packed grouped GEMM op beyond (or, set so, the dequantised stack
    through grouped_mm); every path computes the reference packed experts."""
    mxfp4 = importlib.import_module(kernels.__name__ + ".mxfp4")
    gemv, tiles = "kimik3.mxfp4_gemv", "kimik3.mxfp4_grouped_matmul"
    gemm, dequant, grouped = "kimik3.mxfp4_grouped_gemm", "kimik3.mxfp4_dequant", "aten._grouped_mm"
    e, k = 6, 3  # GEMV up to 12 routed rows (4 tokens), tiles up to 96 (32 tokens)
    # GEMM up to 256 rows per expert on average: from 33 tokens to 512; beyond, chunks of dequantised experts (a
    # chunk budget of one expert's copy and a half: several chunks, one expert each)
    for n, expected in ((1, {gemv}), (4, {gemv}), (5, {tiles}), (32, {tiles}), (33, {gemm}), (512, {gemm}),
                        (513, {dequant, grouped})):
        x, idx, w, gate_up, down = _moe_case(n=n, k=k, e=e)
        args = (*ops.quantize_mxfp4(gate_up), *ops.quantize_mxfp4(down), 4.0, 25.0)
        with torch.no_grad(), TopLevelOps() as seen, pytest.MonkeyPatch.context() as mp:
            mp.setattr(mxfp4, "MXFP4_DEQUANT_CHUNK_BYTES", gate_up.numel() // e * 2 * 3 // 2)
            out = mxfp4.moe_experts_mxfp4(x, idx, w, *args)
        assert seen.names & {gemv, tiles, gemm, dequant, grouped} == expected, (n, seen.names)
        torch.testing.assert_close(out, ops.moe_experts_mxfp4(x, idx, w, *args), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("chunk_experts", [1, 2, 4, 6])
def test_mxfp4_dequantised_matmul_in_chunks_matches_float64(chunk_experts, monkeypatch):
    """The many-rows path and the gradient of every packed path: chunks of experts dequantised within the byte
    budget (one expert, two, a chunk ending past the stack, the whole stack), empty groups, rows past the last group
    zero; forward and dx equal the float64 products."""
    mxfp4 = importlib.import_module(kernels.__name__ + ".mxfp4")
    counts = torch.tensor([3, 0, 5, 1, 0, 4])
    ends = torch.cumsum(counts, 0).to(torch.int32)
    packed, scale = ops.quantize_mxfp4(torch.randn(6, 24, 64) * 0.3)
    weight = ops.dequantize_mxfp4(packed, scale, torch.float64)
    monkeypatch.setattr(mxfp4, "MXFP4_DEQUANT_CHUNK_BYTES", chunk_experts * 24 * 64 * 4)
    xs = torch.randn(int(counts.sum()) + 2, 64, requires_grad=True)  # f32: grouped_mm has no f64
    out = mxfp4.mxfp4_dequantised_matmul(xs, packed, scale, ends).double()
    starts = (ends - counts).tolist()
    ref = torch.zeros(xs.shape[0], 24, dtype=torch.float64)
    for e, (a, b) in enumerate(zip(starts, ends.tolist())):
        ref[a:b] = xs[a:b].detach().double() @ weight[e].T
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(out).float()
    (dx,) = torch.autograd.grad(out, xs, dy)
    dx_ref = torch.zeros_like(xs, dtype=torch.float64)
    for e, (a, b) in enumerate(zip(starts, ends.tolist())):
        dx_ref[a:b] = dy[a:b].double() @ weight[e]
    torch.testing.assert_close(dx.double(), dx_ref, rtol=1e-5, atol=1e-5)


def test_twins_a_compiled_graph_asks_for_load_on_the_first_eager_fast_call(fake_fast_ops, monkeypatch):
    """An import inside a trace is a graph break: the first eager fast-path decision loads every traceable twin (a
    compiled decode step's fused_recurrent_kda would otherwise be loaded for the first time inside the trace); a CPU
    decision loads nothing, one under compile only the twin it asks for."""
    loaded = []
    monkeypatch.setattr(dispatch, "_KERNELS",
                        types.SimpleNamespace(load=lambda n: loaded.append(n) or fake_fast_ops[n]))
    monkeypatch.setattr(dispatch, "_traced_twins_loaded", False)
    dispatch.fast_or_reference("situ_glu", torch.randn(2, 3))
    assert loaded == []
    with pytest.MonkeyPatch.context() as compiling:
        compiling.setattr(torch.compiler, "is_compiling", lambda: True)
        with torch.no_grad():
            assert dispatch.fast_or_reference("situ_glu", fake_cuda(2, 3))() == "situ_glu"
    assert loaded == ["situ_glu"]
    loaded.clear()
    assert dispatch.fast_or_reference("rms_norm", fake_cuda(2, 3, dtype=torch.bfloat16))() == "rms_norm"
    traced = {n for n, op in dispatch.FAST_OPS.items() if op.traceable or op.traceable_forward}
    assert {"fused_recurrent_kda", "causal_conv1d", "mla_decode"} <= traced
    assert set(loaded) == traced | {"rms_norm"} and loaded[-1] == "rms_norm"
    loaded.clear()
    dispatch.fast_or_reference("rms_norm", fake_cuda(2, 3, dtype=torch.bfloat16))
    assert loaded == ["rms_norm"]


def test_has_fast_twin_is_what_fast_or_reference_gives(fake_fast_ops, monkeypatch):
    b = fake_cuda(2, 3, dtype=torch.bfloat16)
    assert dispatch.has_fast_twin("chunk_kda", b) and dispatch.has_fast_twin("causal_conv1d", b)
    assert not dispatch.has_fast_twin("chunk_kda", torch.randn(2, 3))  # CPU
    monkeypatch.setenv(dispatch.REFERENCE_ONLY_ENV, "chunk_kda")
    assert not dispatch.has_fast_twin("chunk_kda", b) and dispatch.has_fast_twin("causal_conv1d", b)


# ------------------------------------------------------------------------------- the KDA layer's predicates


def test_conv_normalizes_qk_only_before_the_fast_chunked_form(fake_fast_ops, monkeypatch):
    """The q/k norm folds into the conv exactly where both fast twins run the chunked form of an inference forward:
    never on CPU (the references), for a decode step, a recorded step, the context-parallel split, while autograd
    records through q or k, or with either op forced to its reference; a one-token forward of a new sequence is a
    chunked one."""
    q, k, state = fake_cuda(1, 4, 8, dtype=torch.bfloat16), fake_cuda(1, 4, 8, dtype=torch.bfloat16), fake_cuda(1)

    def folds(q=q, k=k, state=state, decode_step=False, recording=False, context_parallel=False):
        return dispatch.conv_normalizes_qk(q, k, state, decode_step=decode_step, recording=recording,
                                           context_parallel=context_parallel)

    assert folds() and folds(state=None) and folds(decode_step=True, state=None)
    assert not folds(decode_step=True)
    assert not folds(recording=True) and not folds(context_parallel=True)
    assert not folds(q=torch.randn(1, 4, 8, dtype=torch.bfloat16), k=torch.randn(1, 4, 8, dtype=torch.bfloat16))
    trained = fake_cuda(1, 4, 8, dtype=torch.bfloat16, requires_grad=True)
    assert not folds(q=trained) and not folds(k=trained)
    with torch.no_grad():
        assert folds(q=trained, k=trained)
    for forced in ("causal_conv1d", "chunk_kda"):
        monkeypatch.setenv(dispatch.REFERENCE_ONLY_ENV, forced)
        assert not folds(), forced


def test_decay_in_chunk_kernel_only_where_nothing_else_needs_the_decay():
    """K3's lower-bounded gate moves into the chunked kernel for an unpadded, unrecorded, unsplit forward without
    autograd through the logits or the gate's parameters, on any device (the reference computes it the same way)."""
    logits, A_log, dt_bias = torch.randn(1, 4, 2, 8), torch.randn(2), torch.randn(16)

    def moves(logits=logits, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, padded=False, recording=False,
              context_parallel=False):
        return dispatch.decay_in_chunk_kernel(logits, A_log, dt_bias, lower_bound=lower_bound, padded=padded,
                                              recording=recording, context_parallel=context_parallel)

    assert moves()
    assert not moves(lower_bound=None)  # Kimi Linear's softplus gate
    assert not moves(padded=True) and not moves(recording=True) and not moves(context_parallel=True)
    for trained in ({"logits": logits.clone().requires_grad_()}, {"A_log": A_log.clone().requires_grad_()},
                    {"dt_bias": dt_bias.clone().requires_grad_()}):
        assert not moves(**trained), trained
        with torch.no_grad():
            assert moves(**trained), trained


def test_kda_recurrence_runs_the_recurrent_form_for_a_decode_step_only(fake_fast_ops):
    """One token continuing a state: the fused recurrent form (its decay from the gate's op first); one token of a
    new sequence, or more tokens: the chunked form, which takes the gate itself."""
    q = fake_cuda(1, 1, 2, 8, dtype=torch.bfloat16)
    state, gate = fake_cuda(1, 2, 8, 8), (fake_cuda(2), fake_cuda(16), -5.0)
    args = (q, q, q, q, fake_cuda(1, 1, 2))
    assert dispatch.kda_recurrence(*args, state, True, 64, decode_step=True) == "fused_recurrent_kda"
    assert dispatch.kda_recurrence(*args, None, True, 64, decode_step=True) == "chunk_kda"
    assert dispatch.kda_recurrence(*args, state, True, 64, decode_step=False, gate=gate) == "chunk_kda"
    calls = []
    fake_fast_ops["kda_gate"] = lambda *a: calls.append("kda_gate") or "decay"
    fake_fast_ops["fused_recurrent_kda"] = lambda q, k, v, g, *a, **kw: calls.append(g) or "fused_recurrent_kda"
    with torch.no_grad():
        assert dispatch.kda_recurrence(*args, state, True, 64, decode_step=True, gate=gate) == "fused_recurrent_kda"
    assert calls == ["kda_gate", "decay"]


def test_fast_op_declares_each_op_once():
    """`@fast_op` fills FAST_OPS with the reference itself; a second reference under a declared name is refused
    (one declaration per op), the same function declared again (a reloaded module) is not."""
    assert dispatch.FAST_OPS["situ_glu"].reference is ops.situ_glu
    assert dispatch.FAST_OPS["situ_glu"] == dispatch.FastOp(ops.situ_glu, traceable_forward=True)

    def situ_glu(gate, up, beta, linear_beta):
        return gate

    with pytest.raises(ValueError, match="'situ_glu' is declared twice"):
        dispatch.fast_op()(situ_glu)
    with pytest.raises(ValueError, match="'mxfp4_dequant' is declared twice"):
        dispatch.fast_op("mxfp4_dequant")(situ_glu)
    assert dispatch.FAST_OPS["situ_glu"].reference is ops.situ_glu
    declared = dict(dispatch.FAST_OPS)
    assert dispatch.fast_op(traceable_forward=True)(ops.situ_glu) is ops.situ_glu
    assert dispatch.FAST_OPS == declared
