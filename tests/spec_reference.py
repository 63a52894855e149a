"""An independent, deliberately naive Kimi K3 forward written from k3_math.md, token by token, from a state dict.

It shares no code with the model: per-token KDA recurrence, explicit softmax attention over expanded K/V, a per-token
loop over selected experts, and the section-0 residual bookkeeping spelled out. Used to check the model's logits.
"""

import math

import torch


def rms(x, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)


def kimi_rmsnorm(x, w, eps):
    return w * rms(x.float(), eps).to(x.dtype)


def situ(a, u, b1, b2):
    a, u = a.float(), u.float()
    return (b1 * torch.tanh(a / b1) * torch.sigmoid(a)) * (b2 * torch.tanh(u / b2))


def act(cfg, a, u, dtype):
    if cfg["hidden_act"] == "silu":
        return torch.nn.functional.silu(a) * u
    return situ(a, u, cfg.get("activation_situ_beta") or 1.0, cfg["activation_situ_linear_beta"]).to(dtype)


def lin(x, w):
    return x @ w.t()


def kda_layer(cfg, sd, p, x):
    """x: [T, D] normalised layer input (one sequence)."""
    lac = cfg["linear_attn_config"]
    H, Dk, K = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    T = x.shape[0]
    outs = {}
    for name in "qkv":
        pre = lin(x, sd[p + f"{name}_proj.weight"])
        w = sd[p + f"{name}_conv1d.weight"].float()[:, 0, :]  # [C, K]
        padded = torch.cat([torch.zeros(K - 1, pre.shape[1], dtype=pre.dtype), pre])
        y = torch.stack([(padded[t:t + K].float() * w.t()).sum(0) for t in range(T)])
        outs[name] = torch.nn.functional.silu(y).to(x.dtype).view(T, H, Dk).float()
    q = outs["q"] / torch.sqrt((outs["q"] ** 2).sum(-1, keepdim=True) + 1e-6) / math.sqrt(Dk)
    k = outs["k"] / torch.sqrt((outs["k"] ** 2).sum(-1, keepdim=True) + 1e-6)
    v = outs["v"]
    z = lin(lin(x, sd[p + "f_a_proj.weight"]), sd[p + "f_b_proj.weight"]).float().view(T, H, Dk)
    z = z + sd[p + "dt_bias"].float().view(H, Dk)
    a = sd[p + "A_log"].float()[:H].exp().view(H, 1)
    lb = lac.get("gate_lower_bound")
    g = lb * torch.sigmoid(a * z) if lb is not None else -a * torch.nn.functional.softplus(z)
    beta = torch.sigmoid(lin(x, sd[p + "b_proj.weight"]).float())
    S = torch.zeros(H, Dk, Dk)
    o = torch.zeros(T, H, Dk)
    for t in range(T):
        for h in range(H):
            S[h] = torch.diag(g[t, h].exp()) @ S[h]
            S[h] = S[h] + beta[t, h] * torch.outer(k[t, h], v[t, h] - S[h].t() @ k[t, h])
            o[t, h] = S[h].t() @ q[t, h]
    o = o.to(x.dtype).float()
    if lac.get("use_full_rank_gate"):
        gate = lin(x, sd[p + "g_proj.weight"])
    else:
        gate = lin(lin(x, sd[p + "g_a_proj.weight"]), sd[p + "g_b_proj.weight"])
    gate = gate.float().view(T, H, Dk)
    on = o / torch.sqrt((o ** 2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]) * sd[p + "o_norm.weight"].float()
    y = (on * torch.sigmoid(gate)).to(x.dtype).reshape(T, H * Dk)
    return lin(y, sd[p + "o_proj.weight"])


def mla_layer(cfg, sd, p, x):
    H, dn, dr, dv, R = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                        cfg["v_head_dim"], cfg["kv_lora_rank"])
    T = x.shape[0]
    if cfg.get("q_lora_rank"):
        q = lin(kimi_rmsnorm(lin(x, sd[p + "q_a_proj.weight"]), sd[p + "q_a_layernorm.weight"], 1e-6),
                sd[p + "q_b_proj.weight"])
    else:
        q = lin(x, sd[p + "q_proj.weight"])
    q = q.view(T, H, dn + dr)
    ckv = lin(x, sd[p + "kv_a_proj_with_mqa.weight"])
    c = kimi_rmsnorm(ckv[:, :R], sd[p + "kv_a_layernorm.weight"], 1e-6)
    k_pe = ckv[:, R:]
    kv = lin(c, sd[p + "kv_b_proj.weight"]).view(T, H, dn + dv)
    out = torch.zeros(T, H, dv, dtype=x.dtype)
    for h in range(H):
        key = torch.cat([kv[:, h, :dn], k_pe], -1)
        for t in range(T):
            s = (key[: t + 1] @ q[t, h]).float() / math.sqrt(dn + dr)
            pr = torch.softmax(s, 0).to(x.dtype)
            out[t, h] = pr @ kv[: t + 1, h, dn:]
    out = out.reshape(T, H * dv)
    if cfg.get("mla_use_output_gate"):
        out = out * torch.sigmoid(lin(x, sd[p + "g_proj.weight"]))
    return lin(out, sd[p + "o_proj.weight"])


def moe_layer(cfg, sd, p, x):
    T, D = x.shape
    k = cfg["num_experts_per_token"]
    logits = x.float() @ sd[p + "gate.weight"].float().t()
    s = torch.sigmoid(logits)
    chosen = torch.topk(s + sd[p + "gate.e_score_correction_bias"].float(), k, dim=-1).indices
    latent = cfg.get("routed_expert_hidden_size")
    z = lin(x, sd[p + "routed_expert_down_proj.weight"]) if latent else x
    I = cfg["moe_intermediate_size"]
    routed = torch.zeros(T, z.shape[1], dtype=x.dtype)
    for t in range(T):
        w = s[t, chosen[t]]
        w = w / (w.sum() + 1e-20) * cfg["routed_scaling_factor"]
        acc = torch.zeros(z.shape[1])
        for j, e in enumerate(chosen[t].tolist()):
            gu = sd[p + "experts.gate_up_proj"][e]
            h = act(cfg, lin(z[t], gu[:I]), lin(z[t], gu[I:]), x.dtype)
            acc += w[j] * lin(h, sd[p + "experts.down_proj"][e]).float()
        routed[t] = acc.to(x.dtype)
    if latent:
        if cfg.get("latent_moe_use_norm"):
            routed = kimi_rmsnorm(routed, sd[p + "routed_expert_norm.weight"], cfg["rms_norm_eps"])
        routed = lin(routed, sd[p + "routed_expert_up_proj.weight"])
    shared = 0
    if cfg.get("num_shared_experts"):
        shared = lin(act(cfg, lin(x, sd[p + "shared_experts.gate_proj.weight"]),
                         lin(x, sd[p + "shared_experts.up_proj.weight"]), x.dtype),
                     sd[p + "shared_experts.down_proj.weight"])
    return routed + shared


def dense_mlp(cfg, sd, p, x):
    return lin(act(cfg, lin(x, sd[p + "gate_proj.weight"]), lin(x, sd[p + "up_proj.weight"]), x.dtype),
               sd[p + "down_proj.weight"])


def mix(cands, gamma, proj, eps):
    V = torch.stack(cands).float()
    w = gamma.float() * proj.float().reshape(-1)
    scores = torch.stack([(rms(V[j], eps) * w).sum(-1) for j in range(V.shape[0])])
    pi = torch.softmax(scores, 0)
    return (pi.unsqueeze(-1) * V).sum(0).to(cands[-1].dtype)


def forward(cfg: dict, sd: dict, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [T, V] for one sequence. cfg: release-style text config dict; sd: our state dict."""
    eps = cfg["rms_norm_eps"]
    lac = cfg["linear_attn_config"]
    kda = set(lac["kda_layers"])  # 1-based
    n = cfg["num_hidden_layers"]
    bs = cfg.get("attn_res_block_size")
    h = sd["model.embed_tokens.weight"][input_ids]
    P, B = h, []
    for l in range(n):
        p = f"model.layers.{l}."
        attn = kda_layer if (l + 1) in kda else mla_layer
        ffn = dense_mlp if l < cfg["first_k_dense_replace"] else moe_layer
        if bs is None:
            P = P + attn(cfg, sd, p + "self_attn.", kimi_rmsnorm(P, sd[p + "input_layernorm.weight"], eps))
            P = P + ffn(cfg, sd, p + "mlp.", kimi_rmsnorm(P, sd[p + "post_attention_layernorm.weight"], eps))
            continue
        a_in = P if l == 0 else mix(B + [P], sd[p + "self_attention_res_norm.weight"],
                                    sd[p + "self_attention_res_proj.weight"], eps)
        fresh = False
        if l % bs == 0:
            B.append(P)
            fresh = True
        a = attn(cfg, sd, p + "self_attn.", kimi_rmsnorm(a_in, sd[p + "input_layernorm.weight"], eps))
        P = a if fresh else P + a
        m_in = mix(B + [P], sd[p + "mlp_res_norm.weight"], sd[p + "mlp_res_proj.weight"], eps)
        P = P + ffn(cfg, sd, p + "mlp.", kimi_rmsnorm(m_in, sd[p + "post_attention_layernorm.weight"], eps))
    if bs is not None:
        P = mix(B + [P], sd["model.output_attn_res_norm.weight"], sd["model.output_attn_res_proj.weight"], eps)
    return lin(kimi_rmsnorm(P, sd["model.norm.weight"], eps), sd["lm_head.weight"])
