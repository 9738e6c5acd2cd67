"""PyTorch reference paged attention: KV write by slot_mapping, then gather + SDPA.

Runs on CPU and GPU without host synchronisation: shapes come from the host-side counts in the
metadata. Decode rows (one query token) are batched into one gathered attention; prefill chunks
run one SDPA each, causal inside the chunk and full over the cached prefix.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from graphrunner.attention.metadata import AttentionMetadata


def write_kv_ref(
    key: torch.Tensor,           # [T, Hkv, D]
    value: torch.Tensor,         # [T, Hkv, D]
    layer_cache: torch.Tensor,   # [2, num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = padding
) -> None:
    """Scatter this step's keys/values into their slots; padding tokens (slot -1) are dropped."""
    num_slots = layer_cache.shape[1] * layer_cache.shape[2]
    flat = layer_cache.view(2, num_slots, *layer_cache.shape[3:])
    # Padding is redirected onto slot 0 with slot 0's own contents (a no-op write): block 0 is the
    # pool's reserved null block, so no real token lives there, and no boolean mask (a host sync) is needed.
    valid = (slot_mapping >= 0).view(-1, 1, 1)
    target = slot_mapping.clamp(min=0)
    for i, src in enumerate((key, value)):
        data = torch.where(valid, src.to(layer_cache.dtype), flat[i, :1])
        flat[i].index_copy_(0, target, data)


SHORT_QUERY = 16  # queries up to this many tokens per request share the batched (decode) path


def _decode_plan(meta: AttentionMetadata, device: torch.device) -> dict[str, object]:
    """Per-step tensors for the batched decode path, built once and cached on the metadata."""
    plan = meta.backend_cache.get("ref_plan")
    if plan is None:
        starts = [0]
        for q_len in meta.query_lens_cpu:
            starts.append(starts[-1] + q_len)
        # decodes and short queries (speculative verify steps: 1 + k tokens) go through the batched path, one
        # entry per query token; `back` = how many of its request's query tokens come after it
        decode = [b for b, q in enumerate(meta.query_lens_cpu) if 1 <= q <= SHORT_QUERY]
        prefill = [b for b, q in enumerate(meta.query_lens_cpu) if not 1 <= q <= SHORT_QUERY]
        max_decode_seq = max((meta.seq_lens_cpu[b] for b in decode), default=0)
        tok_rows = [b for b in decode for _ in range(meta.query_lens_cpu[b])]
        tok_idx = [starts[b] + i for b in decode for i in range(meta.query_lens_cpu[b])]
        back = [meta.query_lens_cpu[b] - 1 - i for b in decode for i in range(meta.query_lens_cpu[b])]
        idx = torch.tensor([tok_rows, tok_idx, back], dtype=torch.int64)  # [3, Nt] rows, tokens, tokens after
        if device.type == "cuda":
            idx = idx.pin_memory().to(device, non_blocking=True)
        plan = {"decode_rows": idx[0], "decode_tokens": idx[1], "decode_back": idx[2], "num_decode": len(tok_idx),
                "max_decode_seq": max_decode_seq, "prefill_rows": prefill, "starts": starts}
        meta.backend_cache["ref_plan"] = plan
    return plan


def _gather_kv(layer_cache: torch.Tensor, block_rows: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather the first `length` cached positions of each request: returns K, V [N, length, Hkv, D]."""
    block_size = layer_cache.shape[2]
    nblk = -(-length // block_size)
    blocks = block_rows[:, :nblk].long()  # [N, nblk]
    k = layer_cache[0][blocks].flatten(1, 2)[:, :length]
    v = layer_cache[1][blocks].flatten(1, 2)[:, :length]
    return k, v


def paged_attention_ref(
    query: torch.Tensor,        # [T, Hq, D]
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D], this step's KV already written
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:              # [T, Hq, D]
    """Attention of every query token over its request's cached context (causal, optional window,
    optional logit soft-cap: scores = softcap * tanh(scores / softcap))."""
    _, num_heads, head_dim = query.shape
    num_kv_heads = layer_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    plan = _decode_plan(meta, query.device)

    num_decode = int(plan["num_decode"])
    if num_decode:
        rows = plan["decode_rows"]
        assert isinstance(rows, torch.Tensor)
        max_seq = int(plan["max_decode_seq"])
        tok = plan["decode_tokens"]                                       # [Nd] token index of each decode
        assert isinstance(tok, torch.Tensor)
        back = plan["decode_back"]
        assert isinstance(back, torch.Tensor)
        # the context each query token sees (its own position + 1); device seq_lens are exact, the host's may be
        # upper bounds (speculative decoding), which only size the gather
        seq = meta.seq_lens.index_select(0, rows).long() - back           # [Nd]
        k, v = _gather_kv(layer_cache, meta.block_table.index_select(0, rows), max_seq)  # [Nd, S, Hkv, D]
        q = query.index_select(0, tok).view(num_decode, num_kv_heads, group, head_dim).float()
        scores = torch.einsum("nhgd,nshd->nhgs", q, k.float()) * scale     # [Nd, Hkv, G, S]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        pos = torch.arange(max_seq, device=query.device)
        allowed = pos[None, :] < seq[:, None]                             # [Nd, S]
        if sliding_window is not None:
            allowed &= pos[None, :] > (seq[:, None] - 1 - sliding_window)
        scores = scores.masked_fill(~allowed[:, None, None, :], -math.inf)
        probs = torch.softmax(scores, dim=-1)
        # Positions past a request's length hold other requests' (or stale) values: a NaN there would turn
        # 0 * NaN into NaN, so they are zeroed to keep one bad request from poisoning the others.
        v = v.float().masked_fill(~allowed[:, :, None, None], 0.0)
        o = torch.einsum("nhgs,nshd->nhgd", probs, v).reshape(num_decode, num_heads, head_dim)
        out.index_copy_(0, tok, o.to(query.dtype))

    starts = plan["starts"]
    assert isinstance(starts, list)
    for b in plan["prefill_rows"]:  # type: ignore[union-attr]
        # seq_lens_cpu may be an upper bound (speculative decoding: the host does not know how many drafts the
        # step in flight accepted); the device seq_lens are exact, so positions come from them, and the gathered
        # context past them is masked (and its values zeroed: stale slots there may hold anything)
        q_len, s_len, start = meta.query_lens_cpu[b], meta.seq_lens_cpu[b], starts[b]
        q = query[start:start + q_len].transpose(0, 1)                    # [Hq, q, D]
        k, v = _gather_kv(layer_cache, meta.block_table[b:b + 1], s_len)  # [1, s, Hkv, D]
        k = k[0].transpose(0, 1).repeat_interleave(group, dim=0)          # [Hq, s, D]
        v = v[0].transpose(0, 1).repeat_interleave(group, dim=0)
        seq = meta.seq_lens[b].long()                                     # [] exact context length
        q_pos = seq - q_len + torch.arange(q_len, device=query.device)
        k_pos = torch.arange(s_len, device=query.device)
        k = k.masked_fill((k_pos >= seq)[None, :, None], 0.0)
        v = v.masked_fill((k_pos >= seq)[None, :, None], 0.0)
        mask = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= k_pos[None, :] > (q_pos[:, None] - sliding_window)
        if softcap is None:
            o = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0).to(q.dtype), v.unsqueeze(0).to(q.dtype),
                                               attn_mask=mask, scale=scale)
        else:  # SDPA has no soft-cap: the same math written out, in fp32
            sc = torch.einsum("hqd,hsd->hqs", q.float(), k.float()) * scale
            sc = (softcap * torch.tanh(sc / softcap)).masked_fill(~mask, -math.inf)
            o = torch.einsum("hqs,hsd->hqd", sc.softmax(-1), v.float()).to(q.dtype).unsqueeze(0)
        out[start:start + q_len] = o[0].transpose(0, 1)
    return out
