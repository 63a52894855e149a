"""The experts-format room (experts_format_kimi_k3.py): a format registered there is a value of `experts_format`
everywhere, and the model runs it with no other change. The stand-in here (int8 codes with one f32 scale per row, no
op of its own) is defined in this test only: the config accepts it, the model builds its tensors, runs the experts
through its `run`, offers adapter points (its tensors take no gradient), saves and loads its state dict; the same
model with the decoded experts stored dense gives the same logits."""

import pytest
import torch

from kimik3.modeling import experts_format_kimi_k3 as formats
from kimik3.modeling.configuration_kimi_k3 import KimiK3TextConfig, check_experts_format
from kimik3.modeling.modeling_kimi_k3 import KimiK3Experts, KimiK3ForCausalLM
from kimik3.tiny import build_tiny_model


class Int8RowExperts(formats.ExpertsFormat):
    name = "int8-row"
    suffixes = ("_q", "_s")
    release_suffixes = ("weight_q", "weight_s")
    op = None
    trainable = False
    description = "as int8 rows"

    def empty(self, shape, dtype):
        return torch.zeros(shape, dtype=torch.int8), torch.ones(*shape[:-1], 1, dtype=torch.float32)

    def dense(self, tensors, dtype):
        codes, scales = tensors
        return (codes.float() * scales).to(dtype)

    def dense_shape(self, tensors):
        return tuple(tensors[0].shape)

    def from_dense(self, weight):
        scales = weight.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12) / 127
        return torch.round(weight.float() / scales).clamp(-127, 127).to(torch.int8), scales

    def bytes_per_weight(self, dtype_bytes):
        return 1.0

    def run(self, x, top_indices, top_weights, stacks, betas):
        half = len(stacks) // 2
        dense = (self.dense(stacks[:half], x.dtype), self.dense(stacks[half:], x.dtype))
        return formats.DENSE.run(x, top_indices, top_weights, dense, betas)


@pytest.fixture
def stand_in(monkeypatch):
    fmt = Int8RowExperts()
    monkeypatch.setitem(formats.EXPERTS_FORMATS, fmt.name, fmt)
    return fmt


def _copy_in(dense, fmt):
    """The dense tiny model with its experts stored in `fmt` (the rest of the weights as they are), and the dense
    model whose experts are those values decoded."""
    config = dense.config.__class__.from_dict(dense.config.to_dict())
    config.experts_format = fmt.name
    coded = KimiK3ForCausalLM(config)
    coded.load_state_dict(dense.state_dict(), strict=False)
    decoded = build_tiny_model(seed=7)
    with torch.no_grad():
        for name, module in dense.named_modules():
            if isinstance(module, KimiK3Experts):
                target = coded.get_submodule(name)
                for stack in target.STACKS:
                    for tensor, value in zip(target.stored(stack), fmt.from_dense(getattr(module, stack))):
                        tensor.copy_(value)
                    getattr(decoded.get_submodule(name), stack).copy_(fmt.dense(target.stored(stack), torch.float32))
    return coded.eval(), decoded.eval()


def test_a_registered_format_is_a_value_and_runs_with_no_other_change(stand_in, tmp_path):
    assert check_experts_format("int8-row") == "int8-row"
    with pytest.raises(ValueError, match="choose 'dense' or 'mxfp4' or 'int8-row'"):
        check_experts_format("int4")
    with pytest.raises(ValueError, match="experts_format"):
        KimiK3TextConfig(experts_format="int4")
    coded, decoded = _copy_in(build_tiny_model(seed=7), stand_in)
    experts = coded.model.layers[1].mlp.experts
    assert experts.format is stand_in
    assert {n for n, _ in experts.named_parameters()} >= {"gate_up_proj_q", "gate_up_proj_s", "down_proj_q",
                                                          "down_proj_s"}
    assert experts.gate_up_proj_q.dtype == torch.int8 and not experts.gate_up_proj_q.requires_grad
    # adapter points: the dense names and shapes, one element of memory, not in the state dict
    assert experts.gate_up_proj.shape == experts.gate_up_proj_q.shape and experts.gate_up_proj.stride() == (0, 0, 0)
    state = coded.state_dict()
    assert not any(k.endswith((".gate_up_proj", ".down_proj")) for k in state)
    ids = torch.randint(0, coded.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(coded(ids).logits, decoded(ids).logits, rtol=0, atol=1e-5)
    # its state dict loads back into a fresh model of the format
    again = KimiK3ForCausalLM(coded.config).eval()
    again.load_state_dict(state, strict=True)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, coded(ids).logits)


def test_the_offline_converter_names_the_formats_it_streams(stand_in, tmp_path):
    """`kimik3 convert` and `adopt` stream the release's own two expert storages in row blocks; a format registered
    elsewhere is a load option, and the converter says so before it reads or writes anything."""
    from kimik3.convert.adopt import adopt
    from kimik3.convert.converter import convert
    from kimik3.convert.errors import ConversionError

    for run in (convert, adopt):
        dst = tmp_path / f"out-{run.__name__}"
        with pytest.raises(ConversionError, match=r"'int8-row': the converter writes dense or mxfp4 .*"
                                                  r"from_pretrained\(\.\.\., experts_format=\.\.\.\)"):
            run(tmp_path / "no-such-release", dst, experts_format="int8-row")
        assert not dst.exists()
