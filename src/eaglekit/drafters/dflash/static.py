"""DFlash on the static fast path: the drafter's context keys/values in preallocated buffers, the block forward of a
fixed shape, so that a whole speculative step runs as one graph (`fused.FusedStep`, one CUDA graph with
`compile=True`).

Every drafter layer keeps one key and one value buffer (1, nkv, capacity + Q, D) (Q = 1 + chain_length, the block):
slots [0, capacity) hold the context (the target states of position p in slot p, written by `extend` with
`index_copy_`), slots [capacity, capacity + Q) the block of the current step. The block's queries attend to the
context slots below the cache length m and to the whole block, under one bool mask of a fixed shape; slots at or
past m (a fused step's padding rows, stale entries of an earlier prompt) are masked until they are overwritten. Same
math as `dflash.DFlashDrafterBackend` (tests compare the two).
"""

from __future__ import annotations

import torch
from torch import nn

from eaglekit.decode import graphs
from eaglekit.decode.static import StaticExtend, attention, rotary_tables


class StaticDFlashNet(nn.Module):
    """The DFlash drafter's context write and block forward over static buffers (the drafter's modules, weights
    shared)."""

    def __init__(self, drafter: nn.Module, capacity: int, block: int):
        super().__init__()
        self.drafter = drafter
        config = drafter.config
        param = drafter.fc.weight
        self.capacity, self.block = capacity, block
        cos, sin = rotary_tables(drafter.rotary_emb, capacity, param.dtype, param.device)
        self.register_buffer("cos", cos, persistent=False)  # (capacity, D)
        self.register_buffer("sin", sin, persistent=False)
        shape = (1, config.num_key_value_heads, capacity + block, config.resolved_head_dim)
        for i in range(config.num_hidden_layers):
            for kind in ("k", "v"):
                self.register_buffer(f"{kind}_cache_{i}", torch.zeros(shape, dtype=param.dtype, device=param.device),
                                     persistent=False)

    def caches(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's key and value buffers, (1, nkv, capacity + Q, D) each."""
        return getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions][None], self.sin[positions][None]  # (1, T, D) each

    def context(
        self,
        aux: torch.Tensor,  # (T, n_aux * H_target) target states of target_layer_ids
        positions: torch.Tensor,  # (T,)
        slots: torch.Tensor,  # (T,) context slots to write
    ) -> None:
        """Write the context keys/values of T positions into every layer's buffers (`DFlashDrafter.context`)."""
        drafter = self.drafter
        states = drafter.hidden_norm(drafter.fc(aux.to(self.cos.dtype)))[None]  # (1, T, H)
        cos, sin = self._rope(positions)
        for i, layer in enumerate(drafter.layers):
            keys, values = layer.self_attn.project_kv(states, cos, sin)  # (1, nkv, T, D) each
            k_cache, v_cache = self.caches(i)
            k_cache.index_copy_(2, slots, keys)
            v_cache.index_copy_(2, slots, values)

    def forward(
        self,
        ids: torch.Tensor,  # (Q,) the bonus token, then mask tokens
        positions: torch.Tensor,  # (Q,)
        mask: torch.Tensor,  # (1, 1, Q, capacity + Q) bool, True = attend
    ) -> torch.Tensor:
        """The block forward (`DFlashDrafter.forward`) -> draft logits (Q, Vd)."""
        return self.drafter.lm_head(self.hidden(ids, positions, mask))

    def hidden(
        self,
        ids: torch.Tensor,  # (Q,) the bonus token, then mask tokens
        positions: torch.Tensor,  # (Q,)
        mask: torch.Tensor,  # (1, 1, Q, capacity + Q) bool, True = attend
    ) -> torch.Tensor:
        """The block's final hidden states (`DFlashDrafter.hidden_states`) -> (Q, H)."""
        drafter = self.drafter
        x = drafter.embed_tokens(ids[None]).to(self.cos.dtype)  # (1, Q, H)
        cos, sin = self._rope(positions)
        slots = self.capacity + torch.arange(ids.shape[0], device=ids.device)  # (Q,)
        for i, layer in enumerate(drafter.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            keys, values = attn.project_kv(h, cos, sin)  # (1, nkv, Q, D) each
            k_cache, v_cache = self.caches(i)
            k_cache.index_copy_(2, slots, keys)
            v_cache.index_copy_(2, slots, values)
            x = x + attn.output(attention(attn.project_q(h, cos, sin), k_cache, v_cache, mask))  # (1, Q, H)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return drafter.norm(x)[0]  # (Q, H)


class StaticDFlashDrafter(StaticExtend):
    """Drafter backend over `StaticDFlashNet`: `extend` writes the context (its first call, the prompt's, compiled
    for any length) and returns empty (T, 0) hidden states and logits (DFlash drafts from the block alone),
    `block_logits` drafts; the speculative steps run in `fused.FusedStep`."""

    state_sizes = (0, 0)  # DFlash keeps no per-position hidden state or draft logits between steps
    first_slot = 1  # the block slot of the first draft: the bonus token's own output is unused (DFlash's layout)

    def __init__(self, drafter: nn.Module, capacity: int, num_drafts: int, compile: bool = False):
        block = self.first_slot + num_drafts  # the bonus token, then mask tokens
        self.net = StaticDFlashNet(drafter, capacity, block)
        self.device = self.net.cos.device
        self.capacity, self.stable_length = capacity, 0
        self._columns = torch.arange(capacity + block, device=self.device)
        self.compile = compile
        self._prefill = graphs.prefill_compiled(self._first_extend, compile)
        if compile:
            graphs.static_buffers(self.net)

    def _first_extend(self, aux: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor):
        return self._extend(aux, next_ids, positions, 0)

    def _extend(self, aux: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor, stable: int | torch.Tensor):
        """Write T context positions into the slots after the first `stable` -> empty (T, 0) hidden and logits."""
        t = next_ids.shape[0]
        self.net.context(aux, positions, stable + torch.arange(t, device=self.device))
        empty = aux.new_zeros(t, 0)
        return empty, empty

    def block_hidden(self, root_token: torch.Tensor, start: int | torch.Tensor, num_drafts: int) -> torch.Tensor:
        """root_token () at position `start` (= the context length) -> (k, H) the final hidden states of the block
        slots that draft (from `first_slot` on)."""
        q = self.first_slot + num_drafts
        mask_id = self.net.drafter.config.mask_token_id
        ids = torch.cat([root_token.reshape(1), torch.full((q - 1,), mask_id, dtype=torch.long, device=self.device)])
        positions = start + torch.arange(q, device=self.device)  # (Q,)
        visible = (self._columns < start) | (self._columns >= self.capacity)  # (capacity + Q,)
        return self.net.hidden(ids, positions, visible.expand(q, -1)[None, None])[self.first_slot :]  # (k, H)

    def block_logits(self, root_token: torch.Tensor, start: int | torch.Tensor, num_drafts: int) -> torch.Tensor:
        """root_token () at position `start` (= the context length) -> (k, Vd) draft logits of block positions 1..k."""
        return self.net.drafter.lm_head(self.block_hidden(root_token, start, num_drafts))
