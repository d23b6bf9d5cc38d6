"""Fast path: preallocated (static) KV caches for Llama-family dense targets, and what the drafters' static backends
share (`StaticExtend`, `attention`, `rotary_tables`; each type's own static drafter lives in its folder).

gpt-fast style: K/V buffers of fixed capacity written with `index_copy_` at explicit slots, SDPA with
a boolean mask over the whole buffer (True = attend), RoPE tables precomputed once. The target
forward reuses the loaded HF model's own modules (q/k/v/o projections, optional q_norm/k_norm,
norms, MLP, embedding, lm_head), so no weights are copied and Llama, Mistral, Qwen2 (qkv bias) and
Qwen3 (q/k norm) all run through it, sliding-window layers included (each layer's window applied to the
positions of the tokens in the cache slots, `windows.py`); anything else (MoE, MLA, Gemma) uses the eager
backend. With `compile=True` the fixed-shape work runs under `torch.compile(mode="reduce-overhead")`
(CUDA graphs on GPU): the target's plain step, and every speculative step as one graph (`fused.py`:
draft, verify, verification, KV compaction and the drafter's extend). The two prefills (a new length for
every prompt) are compiled once each with a symbolic length and run padded to a multiple of
`PREFILL_BUCKET` tokens, as a CUDA graph recorded once per bucket.
Tests compare every output with the eager reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from eaglekit.decode import graphs
from eaglekit.decode.windows import model_windows, unsupported_kinds, window_mask
from eaglekit.errors import EaglekitError
from eaglekit.targets.capture import find_decoder, text_config

_NEEDED = ("q_proj", "k_proj", "v_proj", "o_proj")
# model types whose decoder layer is exactly: x + attn(norm(x)); x + mlp(norm(x)), plain embedding, RoPE
# (Gemma scales embeddings and adds norms, Phi/Olmo differ too: they stay on the eager path)
STATIC_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None = None,
              fixed_shape: bool = True):
    """SDPA of q (1, nh, T, D) over a whole static cache k, v (1, nkv, S, D) under a bool mask.

    A step compiled for one shape keeps PyTorch's kernel choice. Any other call on a GPU (eager, or the
    prefill compiled for a symbolic length: one new shape per prompt length) avoids cuDNN attention,
    which builds an execution plan for every new shape: measured on an H200, 50-90 ms the first time a
    prompt length is seen (about 1 s for the very first), against a 16-30 ms eager prefill of the
    reference target (`benchmarks/results/latest/decode_probe.json`). K/V heads are repeated for
    grouped-query attention there, for the memory-efficient kernel's sake (with `enable_gqa` the probe
    measured the math kernel's speed)."""
    if not q.is_cuda or (fixed_shape and torch.compiler.is_compiling()):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return attention_without_cudnn(q, k, v, mask, scale)


def attention_without_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                            scale: float | None = None):
    """`attention`'s eager path: K/V heads repeated to the query heads (query head h reads K/V head
    h // (nh / nkv), as `enable_gqa` does), then the memory-efficient kernel, or math where it cannot run."""
    if q.shape[1] != k.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def rotary_tables(rotary: nn.Module, capacity: int, dtype: torch.dtype, device: torch.device):
    """cos, sin (capacity, D) from an HF rotary-embedding module (exact, including rope scaling)."""
    positions = torch.arange(capacity, device=device)[None]
    dummy = torch.zeros(1, capacity, 1, dtype=dtype, device=device)
    cos, sin = rotary(dummy, positions)
    return cos[0].to(dtype), sin[0].to(dtype)


def _find_rotary(model: nn.Module) -> nn.Module:
    for name, module in model.named_modules():
        if name.endswith("rotary_emb"):
            return module
    raise EaglekitError(f"{type(model).__name__} has no rotary_emb module; the static fast path needs a RoPE "
                        "model (use backend=eager)")


def _fuse_layer_weights(layer: nn.Module) -> bool:
    """Give a decoder layer one q/k/v weight and one gate/up weight (non-persistent buffers `qkv_weight`,
    `qkv_bias`, `gate_up_weight`), with the separate projections' parameters re-pointed to views of them: a
    batch-1 step is bound by weight reads, and a small GEMV (k and v are a quarter of q under grouped-query
    attention) reads its bytes at a fraction of the bandwidth a large one does. No weight is copied (the
    model keeps its memory) and the layer's own modules compute the same values. Parameters replaced later
    (not updated in place) are not seen by the fused buffers. False, and the layer left as it is, where the
    weights cannot be viewed so: mixed devices or dtypes, tensor subclasses (quantised or sharded weights),
    biases on some projections only, a biased gate/up."""
    attn, mlp = layer.self_attn, layer.mlp
    projections, gate_up = (attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)
    weights = [m.weight for m in projections + gate_up]
    if getattr(attn, "qkv_weight", None) is not None and attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr():
        return True  # fused before (another backend over the same model)
    biases = [m.bias for m in projections]
    plain = weights[0].device.type != "meta" and all(  # meta: offloaded by accelerate, the weights arrive per call
        type(w) is nn.Parameter and w.device == weights[0].device and w.dtype == weights[0].dtype for w in weights)
    mixed_bias = any(b is None for b in biases) and not all(b is None for b in biases)
    if not plain or mixed_bias or any(m.bias is not None for m in gate_up):
        return False

    def fuse(modules, name: str) -> torch.Tensor:
        tensors = [getattr(m, name) for m in modules]
        fused = torch.cat([t.detach() for t in tensors])  # (sum of out features, in features) or (sum,)
        start = 0
        for module, t in zip(modules, tensors):
            setattr(module, name, nn.Parameter(fused[start : start + t.shape[0]], requires_grad=t.requires_grad))
            start += t.shape[0]
        return fused

    with torch.no_grad():
        attn.register_buffer("qkv_weight", fuse(projections, "weight"), persistent=False)
        attn.register_buffer("qkv_bias", None if biases[0] is None else fuse(projections, "bias"), persistent=False)
        mlp.register_buffer("gate_up_weight", fuse(gate_up, "weight"), persistent=False)
    return True


def check_static_target(config) -> None:
    """Refuse, from its config alone, a target the static fast path does not cover (the reason and the fix)."""
    config = text_config(config)
    if config.model_type not in STATIC_MODEL_TYPES:
        raise EaglekitError(f"the static fast path covers {', '.join(STATIC_MODEL_TYPES)} targets, not "
                            f"'{config.model_type}'; use backend=eager")
    if unsupported_kinds(config):
        raise EaglekitError(f"{', '.join(unsupported_kinds(config))} layers are not covered by the static fast "
                            "path; use backend=eager")


class StaticLlama(nn.Module):
    """A static-KV-cache forward over a loaded HF Llama-family model's modules (weights shared)."""

    def __init__(self, model: nn.Module, capacity: int, aux_layers: tuple[int, ...] | None,
                 fuse_projections: bool = True):
        super().__init__()
        stack = find_decoder(model)
        config = text_config(model.config)
        check_static_target(config)
        for layer in stack.layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if attn is None or not all(hasattr(attn, n) for n in _NEEDED) or not hasattr(mlp, "gate_proj"):
                raise EaglekitError(f"{type(model).__name__} is not a Llama-family dense model (attention with "
                                    "q/k/v/o_proj and a gated MLP); use backend=eager")
        # per layer: its sliding window (None = full attention); windows at least the cache's length change nothing
        self.windows = tuple(None if w is None or w >= capacity else w for w in model_windows(model, stack.layers))
        param = next(model.parameters())
        self.layers, self.norm = stack.layers, stack.norm
        self.embed, self.lm_head = model.get_input_embeddings(), model.get_output_embeddings()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.aux_layers = aux_layers
        self.capacity = capacity
        self.fused = fuse_projections and all(_fuse_layer_weights(layer) for layer in self.layers)
        cos, sin = rotary_tables(_find_rotary(model), capacity, param.dtype, param.device)
        self.register_buffer("cos", cos, persistent=False)  # (capacity, D)
        self.register_buffer("sin", sin, persistent=False)
        # the position of the token in each cache slot (sliding windows count positions, not slots)
        self.register_buffer("slot_positions", torch.zeros(capacity, dtype=torch.long, device=param.device),
                             persistent=False)
        # a buffer per layer for keys and one for values, written in place with index_copy_: a write through a
        # view of one all-layer buffer made inductor copy that whole buffer for every layer
        shape = (1, self.num_kv_heads, capacity, self.head_dim)  # (1, nkv, S, D)
        for i in range(len(self.layers)):
            for kind in ("k", "v"):
                self.register_buffer(f"{kind}_cache_{i}", torch.zeros(shape, dtype=param.dtype, device=param.device),
                                     persistent=False)

    def caches(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's key and value buffers, (1, nkv, S, D) each."""
        return getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")

    def compact(self, base: torch.Tensor | int, nodes: torch.Tensor) -> None:
        """Keep only `nodes` (K,) of the entries written from slot `base` on, moved to base, base + 1, ..."""
        for i in range(len(self.layers)):
            for cache in self.caches(i):
                _compact(cache, 2, base, nodes)
        _compact(self.slot_positions, 0, base, nodes)

    def _qkv(self, attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (1, T, nh*D), k and v (1, T, nkv*D): one GEMM over the fused weight, else the three projections."""
        if not self.fused:
            return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return F.linear(x, attn.qkv_weight, attn.qkv_bias).split([nq, nkv, nkv], dim=-1)

    def _mlp(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return mlp(x)
        gate, up = F.linear(x, mlp.gate_up_weight).chunk(2, dim=-1)  # (1, T, I) each
        return mlp.down_proj(mlp.act_fn(gate) * up)

    def _attention(self, i: int, layer: nn.Module, x: torch.Tensor, cos, sin, slots, mask,
                   fixed_shape: bool) -> torch.Tensor:
        attn = layer.self_attn
        t = x.shape[1]
        q, k, v = self._qkv(attn, x)
        q = q.view(1, t, self.num_heads, self.head_dim)  # (1, T, nh, D)
        k = k.view(1, t, self.num_kv_heads, self.head_dim)  # (1, T, nkv, D)
        v = v.view(1, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (1, nkv, T, D)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # (1, nh|nkv, T, D)
        k_cache, v_cache = self.caches(i)
        k_cache.index_copy_(2, slots, k)
        v_cache.index_copy_(2, slots, v)
        scale = getattr(attn, "scaling", self.head_dim ** -0.5)
        out = attention(q, k_cache, v_cache, mask, scale, fixed_shape)  # (1, nh, T, D)
        return attn.o_proj(out.transpose(1, 2).reshape(1, t, self.num_heads * self.head_dim))

    def forward(
        self,
        ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        slots: torch.Tensor,  # (T,) cache slots the new K/V are written to
        mask: torch.Tensor,  # (1, 1, T, capacity) bool, True = attend
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> logits (T, V), aux states (T, 3H) in `aux_layers` order (None without aux layers)."""
        return self._forward(ids, positions, slots, mask, fixed_shape=True)

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
                rows: torch.Tensor):
        """`forward` for any number of tokens (compiled once with a symbolic length; no cuDNN attention), logits
        only for `rows` (decoding asks for the prompt's last token, the one it goes on from)."""
        return self._forward(ids, positions, slots, mask, fixed_shape=False, rows=rows)

    def _layer_masks(self, positions: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> dict:
        """{window: (1, 1, T, capacity) mask} for every window of the layers (None: `mask` as given); records the
        new tokens' positions in their slots first."""
        masks = {None: mask}
        if any(w is not None for w in self.windows):
            self.slot_positions.index_copy_(0, slots, positions)
            for window in set(self.windows) - {None}:
                masks[window] = window_mask(mask[0, 0], positions, self.slot_positions, window)[None, None]
        return masks

    def _forward(self, ids, positions, slots, mask, fixed_shape: bool, rows: torch.Tensor | None = None):
        x = self.embed(ids[None])  # (1, T, H)
        cos, sin = self.cos[positions][None], self.sin[positions][None]  # (1, T, D)
        masks = self._layer_masks(positions, slots, mask)
        states = {}
        wanted = set(self.aux_layers or ())
        for i, layer in enumerate(self.layers):
            if i in wanted:
                states[i] = x
            x = x + self._attention(i, layer, layer.input_layernorm(x), cos, sin, slots, masks[self.windows[i]],
                                    fixed_shape)
            x = x + self._mlp(layer.mlp, layer.post_attention_layernorm(x))
        if len(self.layers) in wanted:
            states[len(self.layers)] = x
        logits = self.lm_head(self.norm(x if rows is None else x[:, rows]))[0]  # (T, V), or (len(rows), V)
        aux = torch.cat([states[i] for i in self.aux_layers], dim=-1)[0] if self.aux_layers else None
        return logits, aux


# compiled prefills run padded up to a multiple of this many tokens (the padding rows are causal extra
# tokens whose outputs are dropped), so a CUDA graph serves every prompt length of its bucket
PREFILL_BUCKET = 64


def _bucket(length: int, limit: int, compiled: bool = True) -> int:
    """A prefill's padded length: compiled, `length` rounded up to a multiple of PREFILL_BUCKET, at most `limit`;
    else `length`."""
    return max(length, min(-(-length // PREFILL_BUCKET) * PREFILL_BUCKET, limit)) if compiled else length


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x with zero rows appended along dim 0 up to `rows`."""
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])]) if rows > x.shape[0] else x


def _pad_positions(positions: torch.Tensor, rows: int, limit: int) -> torch.Tensor:
    """positions continued by one per appended row up to `rows`, kept below `limit` (the RoPE tables' length)."""
    if rows == positions.shape[0]:
        return positions
    extra = positions[-1] + 1 + torch.arange(rows - positions.shape[0], device=positions.device)
    return torch.cat([positions, extra.clamp_max(limit - 1)])


def _compact(buffer: torch.Tensor, dim: int, base: int, nodes: torch.Tensor) -> None:
    """Move slots base + nodes (K,) to base, base+1, ... along `dim` of a KV buffer, in place."""
    src = base + nodes
    dst = base + torch.arange(nodes.shape[0], device=buffer.device)
    buffer.index_copy_(dim, dst, buffer.index_select(dim, src))


class StaticTarget:
    """Target backend over `StaticLlama` (same methods as `backends.HFTarget`)."""

    def __init__(self, model: nn.Module, capacity: int, aux_layers: tuple[int, ...] | None, compile: bool = False,
                 fuse_projections: bool = True):
        self.net = StaticLlama(model, capacity, aux_layers, fuse_projections)
        self.device = self.net.cos.device
        self.capacity, self.length, self.last_length = capacity, 0, 0
        self.compile = compile
        self.step = graphs.compiled(self.net, compile)
        self.prefill = graphs.prefill_compiled(self.net.prefill, compile)
        self._columns = torch.arange(capacity, device=self.device)
        if compile:
            graphs.static_buffers(self.net)

    def reset(self) -> None:
        """Forget the cached sequence (the buffers are reused; stale slots are masked out)."""
        self.length = self.last_length = 0

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, last_only: bool = False):
        """-> logits (T, V) of the new tokens (with `last_only`, (1, V): the last one's), aux states (T, 3H) or None.
        The first call after `reset` is the prefill: decoding calls it with `last_only`, so the lm_head runs on
        one row instead of the whole prompt."""
        t = ids.shape[0]
        if self.length + t > self.capacity:
            raise EaglekitError(f"static KV cache full ({self.capacity} slots); raise max_length")
        if self.length == 0:  # the prefill: a new length for every prompt
            logits, aux = self._prefill(ids, positions, mask, last_only)
        else:
            full = (self._columns < self.length).expand(t, -1).clone()  # the cached prefix, then the new tokens' mask
            full[:, self.length : self.length + t] = mask
            slots = torch.arange(self.length, self.length + t, device=self.device)
            logits, aux = graphs.call_step(self.step if self.compile else self.net, self.compile, ids, positions, slots,
                                           full[None, None])
        self.length += t
        self.last_length = t
        return (logits[-1:] if last_only else logits), aux

    def _prefill(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, last_only: bool):
        """The first forward, from slot 0; compiled, padded to its bucket by causal rows whose K/V land in slots
        past the sequence (masked until overwritten) and whose outputs are dropped."""
        t = ids.shape[0]
        rows = _bucket(t, self.capacity, self.compile)
        full = self._columns[None] <= torch.arange(rows, device=self.device)[:, None]  # (rows, capacity) causal
        full[:t, :t] = mask
        slots = torch.arange(rows, device=self.device)
        keep = torch.full((1,), t - 1, device=self.device) if last_only else torch.arange(t, device=self.device)
        logits, aux = self.prefill(_pad_rows(ids, rows), _pad_positions(positions, rows, self.capacity), slots,
                                   full[None, None], keep)
        return logits, None if aux is None else aux[:t]

    def keep(self, nodes: torch.Tensor) -> None:
        base = self.length - self.last_length
        self.net.compact(base, nodes)
        self.length = base + nodes.shape[0]
        self.last_length = nodes.shape[0]


class StaticExtend:
    """What the static drafter backends share: `stable_length` (the feature positions written) and `extend`, whose
    first call after `reset` is the prompt's, padded like the target's prefill and compiled (`_prefill`) for any
    prompt length; later calls run `_extend`, which the fused step also calls inside its graph."""

    capacity: int
    compile: bool
    stable_length = 0

    def reset(self) -> None:
        self.stable_length = 0

    def extend(self, aux: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor):
        """Append the accepted positions -> the drafter's hidden states and logits at them."""
        stable, t = self.stable_length, next_ids.shape[0]
        self.stable_length += t
        if stable == 0:  # padded like the target's prefill (`StaticTarget._prefill`)
            rows = _bucket(t, self.capacity, self.compile)
            hidden, logits = self._prefill(_pad_rows(aux, rows), _pad_rows(next_ids, rows),
                                           _pad_positions(positions, rows, self.capacity))
            return hidden[:t], logits[:t]
        return self._extend(aux, next_ids, positions, stable)


