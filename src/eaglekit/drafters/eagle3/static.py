"""The EAGLE-3 drafter on the static fast path: its keys/values in preallocated buffers (slots [0, capacity) for
target-feature positions, then this step's draft slots), RoPE tables precomputed, the drafter's own modules (weights
shared), so that a whole speculative step runs as one graph (`eaglekit.decode.fused.FusedStep`). Same math as
`decode.EagerDrafter` (tests compare the two).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from eaglekit.decode import graphs
from eaglekit.decode.static import StaticExtend, attention, rotary_tables


class StaticDraftNet(nn.Module):
    """One EAGLE-3 drafter step over a static KV cache (the drafter's own modules, weights shared)."""

    def __init__(self, drafter: nn.Module, capacity: int, draft_slots: int):
        super().__init__()
        self.drafter = drafter
        config = drafter.config
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.resolved_head_dim
        param = drafter.fc.weight
        cos, sin = rotary_tables(drafter.rotary_emb, capacity, param.dtype, param.device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        attn, mlp = drafter.midlayer.self_attn, drafter.midlayer.mlp
        # q/k/v in one GEMM and gate/up in another: the same products with fewer kernels per draft level (copies
        # of the weights, taken when the backend is built)
        self.register_buffer("qkv_weight", torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                             persistent=False)
        self.register_buffer("gate_up_weight", torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), persistent=False)
        shape = (1, self.num_kv_heads, capacity + draft_slots, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=param.dtype, device=param.device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=param.dtype, device=param.device), persistent=False)

    def forward(
        self,
        hidden: torch.Tensor,  # (T, H) fused feature or parent output hidden
        ids: torch.Tensor,  # (T,) target-vocab ids of the next token
        positions: torch.Tensor,  # (T,)
        slots: torch.Tensor,  # (T,)
        mask: torch.Tensor,  # (1, 1, T, capacity + draft_slots) bool
        fixed_shape: bool = True,  # False: compiled for a symbolic T (see `attention`)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Same math as `Eagle3Drafter.forward` -> (the next step's hidden (T, H), draft logits (T, Vd))."""
        mid, t = self.drafter.midlayer, ids.shape[0]
        hidden = hidden[None]  # (1, T, H)
        embeds = self.drafter.embed_tokens(ids[None]).to(hidden.dtype)  # (1, T, H)
        normed = mid.hidden_norm(hidden)
        residual = normed if mid.norm_before_residual else hidden
        x = torch.cat([mid.input_layernorm(embeds), normed], dim=-1)  # (1, T, 2H)
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = F.linear(x, self.qkv_weight).split([nq, nkv, nkv], dim=-1)
        q = q.view(1, t, self.num_heads, self.head_dim).transpose(1, 2)  # (1, nh, T, D)
        k = k.view(1, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (1, nkv, T, D)
        v = v.view(1, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, self.cos[positions][None], self.sin[positions][None])
        self.k_cache.index_copy_(2, slots, k)
        self.v_cache.index_copy_(2, slots, v)
        out = attention(q, self.k_cache, self.v_cache, mask, fixed_shape=fixed_shape)  # (1, nh, T, D)
        h = residual + mid.self_attn.o_proj(out.transpose(1, 2).reshape(1, t, nq))
        gate, up = F.linear(mid.post_attention_layernorm(h), self.gate_up_weight).chunk(2, dim=-1)
        h = h + mid.mlp.down_proj(mid.mlp.act_fn(gate) * up)
        hidden_next, logits = self.drafter.head(h)  # the next step's hidden (norm_output: post-norm), logits
        return hidden_next[0], logits[0]


class StaticDrafter(StaticExtend):
    """Drafter backend over `StaticDraftNet` (the prefill extend of `decode.EagerDrafter`'s methods; the
    speculative steps run in `fused.FusedStep`, which calls the step module through `graphs.GraphSteps`).

    Slots [0, capacity) hold target-feature positions; [capacity, capacity + draft_slots) this step's drafts.
    """

    def __init__(self, drafter: nn.Module, capacity: int, draft_slots: int, compile: bool = False):
        self.net = StaticDraftNet(drafter, capacity, draft_slots)
        self.device = self.net.cos.device
        self.capacity, self.total = capacity, capacity + draft_slots
        self.stable_length = 0
        self._columns = torch.arange(self.total, device=self.device)  # (capacity + draft_slots,)
        self.compile = compile
        self._prefill = graphs.prefill_compiled(self._first_extend, compile)
        if compile:
            graphs.static_buffers(self.net)

    @property
    def state_sizes(self) -> tuple[int, int]:
        """What a step hands the next: the root's hidden state (H,) and draft logits (Vd,)."""
        drafter = self.net.drafter
        return drafter.fc.weight.shape[0], drafter.config.draft_vocab_size

    def _first_extend(self, aux: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor):
        return self._extend(aux, next_ids, positions, 0, fixed_shape=False)

    def _extend(self, aux: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor, stable: int | torch.Tensor,
                fixed_shape: bool = True):
        """Append T feature positions after the first `stable`: row r sees columns <= stable + r."""
        t = next_ids.shape[0]
        feature = self.net.drafter.fuse(aux.to(self.net.cos.dtype))  # (T, H)
        offsets = torch.arange(t, device=self.device)
        mask = self._columns[None] <= stable + offsets[:, None]  # (T, capacity + draft_slots)
        return self.net(feature, next_ids, positions, stable + offsets, mask[None, None], fixed_shape)

    def extend_and_draft(self, aux: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                         stable: torch.Tensor, length: torch.Tensor, num_slots: int):
        """`_extend` of T positions after the first `stable` and, in the same drafter forward, `num_slots` P-EAGLE
        mask slots at positions length .. length + num_slots - 1 (the next step's drafts 2 .. k, `parallel.py`): a
        slot sees the first `length` feature positions and the slots before it, as `parallel_logits`' draft step
        does once the next step starts -> hidden (T + num_slots, H), logits (T + num_slots, Vd)."""
        t, drafter = next_ids.shape[0], self.net.drafter
        dtype = self.net.cos.dtype
        offsets, ahead = torch.arange(t, device=self.device), torch.arange(num_slots, device=self.device)
        feature = torch.cat([drafter.fuse(aux.to(dtype)), drafter.mask_feature().to(dtype).expand(num_slots, -1)])
        ids = torch.cat([next_ids, torch.full((num_slots,), drafter.config.mask_token_id, dtype=torch.long,
                                              device=self.device)])
        columns = self._columns[None]  # (1, capacity + draft_slots)
        slot_columns = self.capacity + ahead[:, None]  # (num_slots, 1)
        mask = torch.cat([columns <= stable + offsets[:, None],  # (T, C): causal over the feature positions
                          (columns < length) | ((columns >= self.capacity) & (columns <= slot_columns))])
        return self.net(feature, ids, torch.cat([positions, length + ahead]),
                        torch.cat([stable + offsets, slot_columns[:, 0]]), mask[None, None])

    def step_inputs(self, ids: torch.Tensor, visible: torch.Tensor, stable: int | torch.Tensor):
        """Cache slots and the (1, 1, k, capacity + draft_slots) mask of a draft step of k nodes that see
        the first `stable` feature positions and, among the draft slots, `visible` (k, E + k)."""
        k, used = ids.shape[0], visible.shape[1] - ids.shape[0]
        mask = (self._columns < stable).expand(k, -1).clone()
        mask[:, self.capacity : self.capacity + used + k] = visible
        slots = self.capacity + used + torch.arange(k, device=self.device)
        return slots, mask[None, None]
