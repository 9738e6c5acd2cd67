"""EAGLE-1 head training for a trained demo-style model (`tools/train_demo_model.py train-eagle` runs it): the
target stays frozen; the head (fc over [embedding; feature] plus one decoder layer) learns the target's next
post-norm feature and its next-token distribution, and is saved in vLLM's EagleQwen3ForCausalLM layout.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM


def autocast(device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def _qkv(layer: torch.nn.Module, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The head layer's roped q, k, v [B, heads, S, D] of x [B, S, H] (Qwen3Attention's own steps)."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    attn = layer.self_attn
    shape = (*x.shape[:-1], -1, attn.head_dim)
    q = attn.q_norm(attn.q_proj(x).view(shape)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(x).view(shape)).transpose(1, 2)
    v = attn.v_proj(x).view(shape).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, *cos_sin)
    return q, k, v


def _layer_out(layer: torch.nn.Module, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               allowed: torch.Tensor) -> torch.Tensor:
    """The rest of the decoder layer (input_layernorm is the identity in a head): attention of q over k / v where
    allowed [Sq, Sk] (bool), o_proj, the residual, the MLP and its residual."""
    attn = layer.self_attn
    groups = q.shape[1] // k.shape[1]
    o = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                       attn_mask=allowed, scale=attn.scaling)  # [B, heads, Sq, D]
    h = x + attn.o_proj(o.transpose(1, 2).reshape(*x.shape[:-1], -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def unrolled_outputs(target: Qwen3ForCausalLM, fc: torch.nn.Linear, layer: torch.nn.Module, feats: torch.Tensor,
                     window: torch.Tensor, unroll: int) -> list[torch.Tensor]:
    """The head's output of each draft step j = 1 .. unroll over windows [B, L] with the target's features
    [B, L, H]: step j's [B, L - j, H] at index i sits at position i + j - 1, reads token i + j and step j - 1's
    output at i (step 1: the target's feature f_i), and attends the step-1 keys up to position i (the target's
    features, as the head's observation writes them) plus its own earlier steps' keys at i, as drafting does."""
    n, device = window.shape[1] - 1, window.device
    keys: list[tuple[torch.Tensor, torch.Tensor]] = []  # each step's (k, v) [B, Hkv, L - j, D]
    h, outs = feats[:, :-1], []  # [B, L-1, H]: step 1 reads the target's features
    for j in range(1, min(unroll, n) + 1):
        m = n - j + 1  # indices i = 0 .. m - 1 have a target at position i + j
        x = fc(torch.cat((target.model.embed_tokens(window[:, j:j + m]), h[:, :m]), dim=-1))  # [B, m, H]
        pos = torch.arange(j - 1, j - 1 + m, device=device)[None]
        q, k, v = _qkv(layer, x, target.model.rotary_emb(x, pos))
        keys.append((k, v))
        idx = torch.arange(m, device=device)
        allowed = [torch.arange(n, device=device)[None] <= idx[:, None]]  # step 1's keys: causal
        allowed += [torch.eye(m, kk.shape[2], dtype=torch.bool, device=device) for kk, _ in keys[1:]]
        h = _layer_out(layer, x, q, torch.cat([kk for kk, _ in keys], dim=2), torch.cat([vv for _, vv in keys], dim=2),
                       torch.cat(allowed, dim=1))  # [B, m, H]
        outs.append(h)
    return outs


def eagle_step(target: Qwen3ForCausalLM, fc: torch.nn.Linear, layer: torch.nn.Module, window: torch.Tensor,
               unroll: int = 1) -> torch.Tensor:
    """EAGLE-1's loss on windows [batch, L]: with the target's final (post-norm) hidden states f, the head at
    position p reads (embed(token p + 1), f_p) and should give f_{p + 1} (smooth L1) whose LM-head distribution
    matches the target's at p + 1 (soft cross-entropy, weight 0.1), as the EAGLE paper trains it. unroll > 1 also
    trains draft steps 2 .. unroll as drafting runs them, from the head's own outputs (a training-time test, as
    HASS and EAGLE-3 train); every step's loss counts the same."""
    with torch.no_grad():
        feats = target.model(input_ids=window).last_hidden_state  # [B, L, H]
        want = F.softmax(target.lm_head(feats[:, 1:]).float(), dim=-1)  # [B, L-1, V]: position t + 1 at t
    outs = unrolled_outputs(target, fc, layer, feats, window, unroll)
    loss = torch.zeros((), device=window.device)
    for j, h in enumerate(outs, start=1):
        m = h.shape[1]
        ce = -(want[:, j - 1:j - 1 + m] * F.log_softmax(target.lm_head(h).float(), dim=-1)).sum(-1).mean()
        loss = loss + F.smooth_l1_loss(h.float(), feats[:, j:j + m].float()) + 0.1 * ce
    return loss / len(outs)


def new_head(target: Qwen3ForCausalLM) -> tuple[Qwen3Config, torch.nn.Linear, torch.nn.Module]:
    """A fresh head for `target` on its device: the config it is saved with, fc [H, 2H] and one decoder layer."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    cfg = Qwen3Config.from_dict({**target.config.to_dict(), "num_hidden_layers": 1,
                                 "layer_types": ["full_attention"], "architectures": ["EagleQwen3ForCausalLM"]})
    cfg._attn_implementation = "sdpa"
    device, h = target.device, cfg.hidden_size
    fc = torch.nn.Linear(2 * h, h, bias=True).to(device)
    layer = Qwen3DecoderLayer(cfg, layer_idx=0).to(device)
    layer.input_layernorm = torch.nn.Identity()  # EAGLE's layer 0 reads fc's output directly
    return cfg, fc, layer


def train_eagle(target_dir: Path, train_ids: torch.Tensor, out: Path, steps: int, batch_size: int, seq_len: int,
                lr: float, seed: int, unroll: int = 1, minutes: float = 0.0) -> list[float]:
    """Train a one-layer EAGLE head for the (frozen) model in target_dir on train_ids [N] (on their device) and save
    it to `out` in vLLM's EagleQwen3ForCausalLM layout; returns the loss of every step. `minutes` > 0 ends training
    early (and still saves) once that much time has passed, so a caller's hard time limit never loses the head."""
    from safetensors.torch import save_file

    if unroll < 1:
        raise ValueError(f"unroll must be >= 1, got {unroll}")
    if minutes < 0:
        raise ValueError(f"minutes must be >= 0 (0: no time budget), got {minutes}")
    torch.manual_seed(seed)
    device = train_ids.device
    target = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval().requires_grad_(False)
    cfg, fc, layer = new_head(target)
    params = [*fc.parameters(), *layer.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len + 1, device=device)
    losses: list[float] = []
    deadline = time.monotonic() + minutes * 60 if minutes > 0 else math.inf
    for step in range(steps):
        if time.monotonic() > deadline:
            print(f"eagle: time budget of {minutes} min reached after {step} steps", flush=True)
            break
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / max(1, steps // 10))
        starts = torch.randint(0, len(train_ids) - seq_len - 1, (batch_size,), generator=gen).to(device)
        with autocast(device):
            loss = eagle_step(target, fc, layer, train_ids[starts[:, None] + offsets], unroll)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 20 == 0 or step == steps - 1:
            print(f"eagle step {step + 1}/{steps} loss {losses[-1]:.4f}", flush=True)
    weights = {"fc.weight": fc.weight, "fc.bias": fc.bias}
    weights.update({f"layers.0.{k}": v for k, v in layer.state_dict().items()})
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in weights.items()},
              str(out / "model.safetensors"))
    (out / "config.json").write_text(cfg.to_json_string())
    (out / "training_log.json").write_text(json.dumps({"steps": len(losses), "unroll": unroll, "losses": losses}) + "\n")
    print(f"saved EAGLE head {out}")
    return losses
