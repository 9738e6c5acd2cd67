"""EAGLE-1 head training for a trained demo-style model (`tools/train_demo_model.py train-eagle` runs it): the
target stays frozen; the head (fc over [embedding; feature] plus one decoder layer) learns the target's next
post-norm feature and its next-token distribution, and is saved in vLLM's EagleQwen3ForCausalLM layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM


def autocast(device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def eagle_step(target: Qwen3ForCausalLM, fc: torch.nn.Linear, layer: torch.nn.Module, window: torch.Tensor
               ) -> torch.Tensor:
    """EAGLE-1's loss on windows [batch, S]: with the target's final (post-norm) hidden states f, the head at
    position p reads (embed(token p + 1), f_p) and should give f_{p + 1} (smooth L1) whose LM-head distribution
    matches the target's at p + 1 (soft cross-entropy, weight 0.1), as the EAGLE paper trains it."""
    with torch.no_grad():
        feats = target.model(input_ids=window).last_hidden_state  # [B, S, H]
        want = F.softmax(target.lm_head(feats[:, 1:]).float(), dim=-1)  # [B, S-1, V]
    s = window.shape[1] - 1
    x = fc(torch.cat((target.model.embed_tokens(window[:, 1:]), feats[:, :-1]), dim=-1))  # [B, S-1, H]
    pos = torch.arange(s, device=window.device)[None]
    cos_sin = target.model.rotary_emb(x, pos)
    mask = torch.full((s, s), float("-inf"), device=window.device).triu(1)[None, None]  # causal, additive
    out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
    h = out[0] if isinstance(out, tuple) else out  # [B, S-1, H]
    ce = -(want * F.log_softmax(target.lm_head(h).float(), dim=-1)).sum(-1).mean()
    return F.smooth_l1_loss(h.float(), feats[:, 1:].float()) + 0.1 * ce


def train_eagle(target_dir: Path, train_ids: torch.Tensor, out: Path, steps: int, batch_size: int, seq_len: int,
                lr: float, seed: int) -> list[float]:
    """Train a one-layer EAGLE head for the (frozen) model in target_dir on train_ids [N] (on their device) and save
    it to `out` in vLLM's EagleQwen3ForCausalLM layout; returns the loss of every step."""
    from safetensors.torch import save_file
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    torch.manual_seed(seed)
    device = train_ids.device
    target = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval().requires_grad_(False)
    cfg = Qwen3Config.from_dict({**target.config.to_dict(), "num_hidden_layers": 1,
                                 "layer_types": ["full_attention"], "architectures": ["EagleQwen3ForCausalLM"]})
    cfg._attn_implementation = "sdpa"
    h = cfg.hidden_size
    fc = torch.nn.Linear(2 * h, h, bias=True).to(device)
    layer = Qwen3DecoderLayer(cfg, layer_idx=0).to(device)
    layer.input_layernorm = torch.nn.Identity()  # EAGLE's layer 0 reads fc's output directly
    params = [*fc.parameters(), *layer.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len + 1, device=device)
    losses: list[float] = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / max(1, steps // 10))
        starts = torch.randint(0, len(train_ids) - seq_len - 1, (batch_size,), generator=gen).to(device)
        with autocast(device):
            loss = eagle_step(target, fc, layer, train_ids[starts[:, None] + offsets])
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
    (out / "training_log.json").write_text(json.dumps({"steps": steps, "losses": losses}) + "\n")
    print(f"saved EAGLE head {out}")
    return losses
