"""Packed sequences (transformers.DataCollatorWithFlattening): one row of several documents with restarting
position_ids (and/or cu_seq_lens) must give the loss and gradients of the documents run separately, and neither KDA
(state, short conv) nor MLA may carry information across a document boundary."""

import pytest
import torch
from transformers import DataCollatorWithFlattening

from kimik3.configuration import tiny_text_config_dict
from kimik3.modeling.configuration_kimi_k3 import KimiK3TextConfig
from kimik3.modeling.modeling_kimi_k3 import KimiK3ForCausalLM
from kimik3.training.data import documents, load_text
from training_helpers import load_tiny


def tiny_model(attention: str, seed: int = 0) -> KimiK3ForCausalLM:
    """4 layers, all KDA, all MLA, or the release schedule (KDA, KDA, KDA, MLA); random AttnRes pseudo-queries."""
    cfg = tiny_text_config_dict(num_hidden_layers=4)
    layers = [1, 2, 3, 4]
    if attention == "kda":
        cfg["linear_attn_config"].update(kda_layers=layers, full_attn_layers=[])
    elif attention == "mla":
        cfg["linear_attn_config"].update(kda_layers=[], full_attn_layers=layers)
    torch.manual_seed(seed)
    model = KimiK3ForCausalLM(KimiK3TextConfig(**cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.normal_(0.0, 0.5)
    return model.train()


def three_documents():
    # lengths 37, 50 and 23: not multiples of the KDA chunk (16), nor of the conv window
    docs = documents(load_text())
    return [{"input_ids": docs[i]["input_ids"][:n]} for i, n in ((0, 37), (3, 50), (7, 23))]


COLLATORS = {
    "position_ids": DataCollatorWithFlattening(return_tensors="pt"),
    "cu_seq_lens": DataCollatorWithFlattening(return_tensors="pt", return_position_ids=False,
                                              return_flash_attn_kwargs=True),
    "both": DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=True),
}


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("boundaries", list(COLLATORS))
def test_packed_loss_and_gradients_equal_separate_documents(boundaries):
    model = load_tiny()  # remote code, release schedule
    docs = three_documents()
    packed = COLLATORS[boundaries](docs)
    assert packed["input_ids"].shape == (1, 110)
    assert packed["labels"][0, [0, 37, 87]].tolist() == [-100] * 3  # no loss across a boundary
    out = model(**packed)
    out.loss.backward()
    packed_grads, packed_logits = grads(model), out.logits.detach()
    model.zero_grad()

    # separately: the packed loss is the token mean over all documents
    n_targets = sum(len(d["input_ids"]) - 1 for d in docs)
    total, start = 0.0, 0
    for d in docs:
        ids = torch.tensor([d["input_ids"]])
        o = model(input_ids=ids, labels=ids)
        (o.loss * (ids.shape[1] - 1) / n_targets).backward()
        total += float(o.loss.detach()) * (ids.shape[1] - 1) / n_targets
        torch.testing.assert_close(packed_logits[:, start : start + ids.shape[1]], o.logits.detach(),
                                   rtol=1e-5, atol=5e-6)
        start += ids.shape[1]
    separate_grads = grads(model)
    assert float(out.loss.detach()) == pytest.approx(total, rel=1e-6)
    assert packed_grads.keys() == separate_grads.keys()
    for name, g in separate_grads.items():
        torch.testing.assert_close(packed_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("attention", ["kda", "mla", "hybrid"])
def test_no_leak_across_documents(attention):
    model = tiny_model(attention).eval()
    docs = three_documents()
    changed = [dict(d) for d in docs]
    changed[0] = {"input_ids": list(reversed(docs[0]["input_ids"]))}  # other first document, same length
    collate = COLLATORS["position_ids"]
    with torch.no_grad():
        a = model(**{k: v for k, v in collate(docs).items() if k != "labels"}).logits
        b = model(**{k: v for k, v in collate(changed).items() if k != "labels"}).logits
        # control: the same rows without document boundaries do leak, so the comparison can see a leak
        a_plain = model(input_ids=collate(docs)["input_ids"]).logits
        b_plain = model(input_ids=collate(changed)["input_ids"]).logits
    assert (a[:, :37] - b[:, :37]).abs().max() > 1e-2
    torch.testing.assert_close(a[:, 37:], b[:, 37:], rtol=0, atol=1e-6)
    assert (a_plain[:, 37:] - b_plain[:, 37:]).abs().max() > 1e-3


def test_no_gradient_leak_across_documents():
    model = tiny_model("hybrid")
    packed = COLLATORS["position_ids"](three_documents())
    embeds = model.get_input_embeddings()(packed["input_ids"]).detach().requires_grad_(True)
    labels = packed["labels"].clone()
    labels[:, :87] = -100  # loss on the third document only
    model(inputs_embeds=embeds, labels=labels, position_ids=packed["position_ids"]).loss.backward()
    assert float(embeds.grad[:, :87].abs().max()) == 0.0
    assert float(embeds.grad[:, 87:].abs().max()) > 0.0
