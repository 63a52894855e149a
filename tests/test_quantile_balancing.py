"""Quantile Balancing (k3_math.md 6.5; router contract in docs/design.md) without the model.

A stand-in gate with the contract of `KimiK3MoEGate` (sigmoid scores, top-(k+1) of s + b in training with
`config.quantile_balancing`, observer call) drives the balancer; the model-level tests are in
tests/test_quantile_balancing_model.py.
"""

import math
import os
import tempfile
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.checkpoint import checkpoint

from kimik3.training.quantile_balancing import (
    ExpertLoadMonitor,
    QuantileBalancer,
    QuantileBalancingCallback,
    bin_range,
    estimate_bias_histogram,
    exact_bias,
    expert_loads,
    load_imbalance,
    load_router_bias_state_dict,
    required_bias,
    route_with_bias,
    router_bias_state_dict,
    target_load,
)


# ----------------------------------------------------------------------------------------------------------------------
# synthetic router scores
def skewed_scores(n, e, seed=0, skew=2.0, d=16):
    """Sigmoid scores of a random linear router with a strong per-expert preference (unbalanced at b = 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, e, generator=g) * 0.5
    return torch.sigmoid(x @ w + torch.linspace(-skew, skew, e))


def balance_iterations(scores, k, steps, estimator):
    """Routing with the bias of the previous step, as in training on a repeated batch; returns imbalance per step."""
    bias = torch.zeros(scores.shape[1])
    imbalances = []
    for _ in range(steps):
        idx, cutoff = route_with_bias(scores, bias, k)
        imbalances.append(load_imbalance(expert_loads(idx, scores.shape[1])))
        bias = estimator(scores, cutoff, bias)
    return imbalances, bias


@pytest.mark.parametrize("n,e,k", [(4096, 8, 2), (1000, 8, 3), (777, 16, 1)])
def test_exact_bias_gives_each_expert_the_target_load_at_fixed_cutoff(n, e, k):
    scores = skewed_scores(n, e, seed=n)
    bias = torch.randn(e) * 0.3
    _, cutoff = route_with_bias(scores, bias, k)
    b_hat = exact_bias(scores, cutoff, k, center=False)
    # b_hat_j is the ceil(q)-th smallest r_ij = alpha_i - s_ij: exactly ceil(q) tokens have s_ij + b_hat_j >= alpha_i,
    # up to ties at b_hat_j (the tokens whose (k+1)-th expert is j all have r_ij = b_j of the routing bias).
    # (The quantile level is k/E of r, i.e. 1 - k/E of s - alpha; the level 1 - k/E of r fails this.)
    m = math.ceil(target_load(n, k, e))
    r = required_bias(scores, cutoff)
    below, at_or_below = (r < b_hat).sum(0), (r <= b_hat).sum(0)
    assert (below < m).all() and (at_or_below >= m).all()
    untied = (r == b_hat).sum(0) == 1
    assert untied.sum() >= e // 2  # most experts have no tie: there the count is exact
    assert (at_or_below[untied] == m).all()
    # the update is the mean-centred b_hat
    centred = exact_bias(scores, cutoff, k)
    torch.testing.assert_close(centred, b_hat - b_hat.mean())
    assert abs(float(centred.mean())) < 1e-6


def test_exact_bias_balances_routing():
    n, e, k = 4096, 8, 2
    scores = skewed_scores(n, e)
    imbalances, bias = balance_iterations(scores, k, 12, lambda s, c, b: exact_bias(s, c, k))
    assert imbalances[0] > 2.0  # unbalanced without a bias
    assert imbalances[1] < 0.7 * imbalances[0]  # one step already removes most of it
    assert imbalances[-1] < 1.04
    loads = expert_loads(route_with_bias(scores, bias, k)[0], e).double()
    q = target_load(n, k, e)
    assert ((loads - q).abs() / q).max() < 0.04  # every expert gets ~N k / E tokens


@pytest.mark.parametrize("num_bins", [64, 512, 1000])
@pytest.mark.parametrize("seed", [0, 1])
def test_histogram_estimate_within_one_bin_of_exact(num_bins, seed):
    n, e, k = 3000, 8, 2
    scores = skewed_scores(n, e, seed=seed)
    bias = exact_bias(scores, route_with_bias(scores, torch.zeros(e), k)[1], k)  # a realistic, non-zero bias
    _, cutoff = route_with_bias(scores, bias, k)
    lo, width = bin_range(bias, num_bins)
    r = required_bias(scores, cutoff)
    assert lo < float(r.min()) and float(r.max()) < lo + num_bins * width  # the range always covers r
    exact = exact_bias(scores, cutoff, k, center=False)
    hist = estimate_bias_histogram(scores, cutoff, k, bias, num_bins=num_bins, center=False)
    assert (hist - exact).abs().max() <= width * 1.001
    # the centred update (what is written) is within two bin widths
    centred = estimate_bias_histogram(scores, cutoff, k, bias, num_bins=num_bins)
    assert (centred - exact_bias(scores, cutoff, k)).abs().max() <= 2 * width * 1.001
    assert width < 2.5 / num_bins * (1 + float(bias.max() - bias.min()))


def test_histogram_estimator_balances_routing():
    n, e, k = 4096, 8, 2
    scores = skewed_scores(n, e, seed=3)
    imbalances, _ = balance_iterations(
        scores, k, 12, lambda s, c, b: estimate_bias_histogram(s, c, k, b, num_bins=256)
    )
    assert imbalances[0] > 2.0 and imbalances[-1] < 1.05


# ----------------------------------------------------------------------------------------------------------------------
# stand-in gate with the contract of KimiK3MoEGate
class KimiK3MoEGate(nn.Module):
    def __init__(self, config, hidden_size):
        super().__init__()
        self.config = config
        self.top_k = config.num_experts_per_token
        self.weight = nn.Parameter(torch.randn(config.num_experts, hidden_size) * 0.3)
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))
        self.quantile_balancing_observer = None

    def forward(self, hidden_states, token_mask=None):
        logits = hidden_states.float() @ self.weight.float().t()
        scores = logits.sigmoid()
        biased = scores + self.e_score_correction_bias
        if self.config.quantile_balancing and self.training:
            values, idx = biased.topk(self.top_k + 1, dim=-1)
            idx = idx[:, : self.top_k]
            if self.quantile_balancing_observer is not None:
                self.quantile_balancing_observer(self, scores.detach(), values[:, -1].detach(), idx, token_mask)
        else:
            idx = biased.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, idx)
        weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights, idx


class ToyRouted(nn.Module):
    """Two MoE layers' gates behind linear maps; the gates' top-k weights enter the output (so there is a graph)."""

    def __init__(self, num_experts=8, top_k=2, hidden=16, layers=2, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.config = types.SimpleNamespace(
            num_experts=num_experts, num_experts_per_token=top_k, quantile_balancing=False,
            quantile_balancing_bins=128,
        )
        self.proj = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.gates = nn.ModuleList(KimiK3MoEGate(self.config, hidden) for _ in range(layers))
        with torch.no_grad():  # skew the routers so that there is something to balance
            for gate in self.gates:
                gate.weight[:, 0] += torch.linspace(-3, 3, num_experts)

    def layer(self, i, h, token_mask=None):
        h = self.proj[i](h)
        _, w, _ = self.gates[i](h, token_mask)
        return h * w.sum(-1, keepdim=True)

    def forward(self, h, token_mask=None, use_checkpoint=False):
        for i in range(len(self.proj)):
            if use_checkpoint:
                h = checkpoint(self.layer, i, h, token_mask, use_reentrant=False)
            else:
                h = self.layer(i, h, token_mask)
        return h


def toy_inputs(n, hidden=16, seed=0):
    h = torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed))
    h[:, 0] += 1.0  # the skewed router column sees a non-zero mean
    return h


def test_balancer_sets_config_attaches_observers_and_restores():
    model = ToyRouted()
    assert model.config.quantile_balancing is False
    balancer = QuantileBalancer(model)
    assert model.config.quantile_balancing is True
    assert balancer.num_bins == 128  # from config.quantile_balancing_bins
    assert all(g.quantile_balancing_observer is not None for g in model.gates)
    with pytest.raises(ValueError):  # a second balancer on the same gates is refused
        QuantileBalancer(model)
    balancer.remove()
    assert model.config.quantile_balancing is False
    assert all(g.quantile_balancing_observer is None for g in model.gates)


def test_balancer_counts_routed_experts_when_scores_tie():
    model = ToyRouted(num_experts=4, top_k=2).train()
    balancer = QuantileBalancer(model)
    gate = model.gates[0]
    # every expert scores the same: the gate routes two of four, and the cutoff ties with the routed scores, so
    # "biased score above the cutoff" would count no load at all
    scores = torch.full((6, 4), 0.5)
    values, indices = scores.topk(3, dim=-1)
    routed = indices[:, :2]
    gate.quantile_balancing_observer(gate, scores, values[:, -1], routed, None)
    stats = balancer.step()
    assert torch.equal(stats.loads[0], torch.bincount(routed.reshape(-1), minlength=4))
    assert int(stats.loads[0].sum()) == 6 * 2
    balancer.remove()


def test_balancer_matches_exact_and_applies_from_next_step():
    model = ToyRouted().train()
    balancer = QuantileBalancer(model, num_bins=1000)
    h = toy_inputs(2048)
    before = [g.e_score_correction_bias.clone() for g in model.gates]
    out = model(h)
    out.square().mean().backward()
    # nothing changes during the step
    for g, b in zip(model.gates, before):
        assert torch.equal(g.e_score_correction_bias, b)
    # what the gate saw (first gate: its input is proj[0](h))
    with torch.no_grad():
        scores = torch.sigmoid(model.proj[0](h) @ model.gates[0].weight.t())
        idx, cutoff = route_with_bias(scores, before[0], 2)
    stats = balancer.step()
    assert stats.tokens == 2048
    assert torch.equal(stats.loads[0], expert_loads(idx, 8))  # loads are the routed top-k
    assert stats.layer_imbalance[0] == pytest.approx(load_imbalance(expert_loads(idx, 8)))
    _, width = bin_range(before[0], 1000)
    new = model.gates[0].e_score_correction_bias
    assert (new - exact_bias(scores, cutoff, 2)).abs().max() <= 2 * width
    assert not new.requires_grad and new.grad is None
    assert all("e_score_correction_bias" not in n for n, _ in model.named_parameters())
    # a second step with no forward leaves the bias alone (and warns that nothing was observed)
    snapshot = new.clone()
    with pytest.warns(UserWarning, match="no router call"):
        assert balancer.step() is None
    assert torch.equal(model.gates[0].e_score_correction_bias, snapshot)


def test_balancer_accumulates_micro_batches_ignores_recompute_and_padding():
    h = toy_inputs(1024, seed=1)
    mask = torch.rand(1024, generator=torch.Generator().manual_seed(2)) > 0.3

    def run(chunks, use_checkpoint=False, token_mask=None, inputs=h):
        model = ToyRouted().train()
        balancer = QuantileBalancer(model, num_bins=256)
        for part in chunks:
            m = None if token_mask is None else token_mask[part]
            model(inputs[part], m, use_checkpoint=use_checkpoint).square().mean().backward()
        stats = balancer.step()
        return stats, [g.e_score_correction_bias.clone() for g in model.gates]

    whole, bias_whole = run([slice(0, 1024)])
    micro, bias_micro = run([slice(0, 300), slice(300, 700), slice(700, 1024)])
    ckpt, bias_ckpt = run([slice(0, 1024)], use_checkpoint=True)
    assert whole.tokens == micro.tokens == ckpt.tokens == 1024  # recomputation did not count twice
    for a, b, c in zip(bias_whole, bias_micro, bias_ckpt):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(whole.loads, micro.loads) and torch.equal(whole.loads, ckpt.loads)
    assert float(bias_whole[0].abs().max()) > 0.05  # the skewed router did get a bias

    masked, bias_masked = run([slice(0, 1024)], token_mask=mask)
    kept, bias_kept = run([slice(0, int(mask.sum()))], inputs=h[mask])
    assert masked.tokens == kept.tokens == int(mask.sum())
    for a, b in zip(bias_masked, bias_kept):
        assert torch.equal(a, b)


def test_balancer_balances_over_steps_and_monitor_agrees():
    model = ToyRouted().train()
    monitor = ExpertLoadMonitor(model)
    balancer = QuantileBalancer(model)
    imbalances = []
    for step in range(12):
        model(toy_inputs(1024, seed=100 + step))  # a fresh batch each step
        stats = balancer.step()
        loads = monitor.pop()
        assert torch.equal(loads, stats.loads)  # hook-side and observer-side loads agree
        imbalances.append(stats.load_imbalance)
    assert imbalances[0] > 2.2
    assert sum(imbalances[-6:]) / 6 < 1.2  # fresh batches: sampling noise keeps it from 1.0


def test_bias_state_dict_roundtrip():
    model = ToyRouted().train()
    balancer = QuantileBalancer(model)
    model(toy_inputs(512))
    balancer.step()
    state = router_bias_state_dict(model)
    assert sorted(state) == ["gates.0.e_score_correction_bias", "gates.1.e_score_correction_bias"]
    fresh = ToyRouted()
    load_router_bias_state_dict(fresh, state)
    for g, f in zip(model.gates, fresh.gates):
        assert torch.equal(g.e_score_correction_bias, f.e_score_correction_bias)


def test_callback_updates_at_step_end_and_logs():
    from transformers import TrainerControl, TrainerState, TrainingArguments

    model = ToyRouted().train()
    callback = QuantileBalancingCallback(num_bins=256)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True)
    state, control = TrainerState(), TrainerControl()
    callback.on_train_begin(args, state, control, model=model)
    assert model.config.quantile_balancing is True
    for step in range(1, 4):
        model(toy_inputs(512, seed=step))
        before = model.gates[0].e_score_correction_bias.clone()
        state.global_step = step
        callback.on_step_end(args, state, control, model=model)
        assert not torch.equal(before, model.gates[0].e_score_correction_bias)
    logs = {"loss": 1.0}
    state.log_history.append({**logs, "step": 3})
    callback.on_log(args, state, control, logs=logs)
    assert logs["qb/load_imbalance"] == pytest.approx(sum(h["load_imbalance"] for h in callback.history) / 3)
    assert state.log_history[-1]["qb/load_imbalance"] == logs["qb/load_imbalance"]
    callback.on_train_end(args, state, control, model=model)
    assert model.config.quantile_balancing is False
    assert all(g.quantile_balancing_observer is None for g in model.gates)


# ----------------------------------------------------------------------------------------------------------------------
# two ranks (gloo) with all-reduced histograms == one process seeing the whole batch
def _dist_worker(rank, world, init_file, out_dir):
    # a forked rank cannot use the parent's OpenMP thread pool: with KIMIK3_TEST_THREADS > 1 its first parallel op hung
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        calls = []
        real_all_reduce = dist.all_reduce

        def counting_all_reduce(tensor, *args, **kwargs):
            calls.append(tensor.dtype)
            return real_all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = counting_all_reduce
        model = ToyRouted().train()
        balancer = QuantileBalancer(model, num_bins=256)
        h = toy_inputs(1000, seed=7)
        for step in range(2):
            shard = h[rank::world]  # each rank sees half of the batch, in two micro-batches
            model(shard[:200])
            model(shard[200:])
            balancer.step()
        dist.all_reduce = real_all_reduce
        torch.save(
            {"bias": [g.e_score_correction_bias for g in model.gates], "calls": calls,
             "loads": balancer.last_stats.loads},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def test_two_ranks_all_reduce_equals_one_process(tmp_path):
    world = 2
    # forked, not spawned: a spawned rank re-imports torch, transformers and peft, most of this test's time
    mp.start_processes(_dist_worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world, join=True,
                       start_method="fork")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]

    model = ToyRouted().train()
    balancer = QuantileBalancer(model, num_bins=256)
    h = toy_inputs(1000, seed=7)
    for _ in range(2):
        model(h)
        balancer.step()
    single = [g.e_score_correction_bias for g in model.gates]
    for res in results:
        assert res["calls"] == [torch.long, torch.long]  # one integer all-reduce per step
        for a, b in zip(res["bias"], single):
            assert torch.equal(a, b)
        assert torch.equal(res["loads"], balancer.last_stats.loads)
    assert float(single[0].abs().max()) > 0.05


def test_balancer_ema_mixes_old_and_new_bias():
    h = toy_inputs(1024, seed=5)
    plain_model, ema_model = ToyRouted().train(), ToyRouted().train()
    start = torch.linspace(-0.2, 0.2, 8)
    for model in (plain_model, ema_model):
        for gate in model.gates:
            gate.e_score_correction_bias.copy_(start)
    plain, ema = QuantileBalancer(plain_model), QuantileBalancer(ema_model, ema=0.75)
    plain_model(h)
    ema_model(h)
    plain.step()
    ema.step()
    for p, e in zip(plain_model.gates, ema_model.gates):
        torch.testing.assert_close(e.e_score_correction_bias, 0.75 * start + 0.25 * p.e_score_correction_bias)
        assert not torch.allclose(e.e_score_correction_bias, p.e_score_correction_bias)
