"""DFlash drafters in the engines' layouts: export to vLLM's (and speculators' 0.9.0), import either back, and the
published checkpoints of vLLM's layout (z-lab's `*-DFlash` models), with a logit check on every export.

vLLM 0.32 (`DFlashDraftModel`, vllm/model_executor/models/qwen3_dflash.py) reads a Qwen3 config.json plus
`dflash_config: {mask_token_id, target_layer_ids}` (output-of-layer ids; vLLM captures input-of-layer id + 1) and
the tensors `fc.weight`, `hidden_norm.weight`, `layers.{i}.*` (q/k/v/o_proj, q_norm, k_norm, the MLP and two norms),
`norm.weight`, and optionally `lm_head.weight` (else the target's), `d2t` (a draft vocabulary smaller than the
target's) and `embed_tokens.weight` (else the target's). speculators 0.9.0 (`speculators_model_type: dflash`)
holds the same tensors under a `transformer_layer_config`, with `aux_hidden_state_layer_ids` in the input-of-layer
convention (vLLM converts them by - 1) and `t2d`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from eaglekit.drafters.dflash.model import DEFAULT_BLOCK_SIZE, DFlashConfig, DFlashDrafter, build_from_state
from eaglekit.errors import EaglekitError
from eaglekit.formats.export import write_verified
from eaglekit.formats.files import DTYPE_NAMES, probe_difference, read_config, read_weights, verifier_path

FORMATS = ("vllm", "speculators")
ARCHITECTURE = "DFlashDraftModel"
SPECULATORS_ARCHITECTURE = "DFlashSpeculator"
QWEN3_DEFAULT_THETA = 1_000_000.0  # vLLM's default for a DFlash config that names no rope_theta


def is_dflash_checkpoint(data: dict[str, Any]) -> bool:
    """True for a config.json of a DFlash drafter in any layout this module reads."""
    return (ARCHITECTURE in (data.get("architectures") or []) or "dflash_config" in data
            or data.get("speculators_model_type") == "dflash" or data.get("drafter_type") == "dflash")


# --- export ---------------------------------------------------------------------------------
def qwen3_fields(config: DFlashConfig) -> dict[str, Any]:
    """The Qwen3Config keys of the drafter's layers, as vLLM and speculators read them."""
    rope = dict(config.rope_parameters)
    return {"model_type": "qwen3", "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.resolved_head_dim, "num_hidden_layers": config.num_hidden_layers,
            "vocab_size": config.vocab_size, "rms_norm_eps": config.rms_norm_eps, "hidden_act": config.hidden_act,
            "max_position_embeddings": config.max_position_embeddings, "rope_parameters": rope,
            "rope_theta": float(rope.get("rope_theta", 10000.0)), "attention_bias": False,
            "tie_word_embeddings": False}


def engine_config(config: DFlashConfig, fmt: str, dtype: str) -> dict[str, Any]:
    """config.json of `fmt` for `config`."""
    marker = {"target_name_or_path": config.target_name_or_path, "target_architecture": config.target_architecture,
              "target_weights_hash": config.target_weights_hash}
    if fmt == "speculators":
        return {"architectures": [SPECULATORS_ARCHITECTURE], "speculators_model_type": "dflash",
                "transformer_layer_config": qwen3_fields(config), "draft_vocab_size": config.draft_vocab_size,
                "block_size": config.block_size, "target_hidden_size": config.target_hidden_size,
                "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
                "mask_token_id": config.mask_token_id, "sample_from_anchor": False,
                "num_target_layers": config.target_num_layers, "torch_dtype": dtype, "eaglekit": marker,
                "speculators_config": {
                    "algorithm": "dflash", "default_proposal_method": "greedy",
                    "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.block_size - 1}],
                    "verifier": {"name_or_path": verifier_path(config.target_name_or_path),
                                 "architectures": [config.target_architecture] if config.target_architecture else []}}}
    return {"architectures": [ARCHITECTURE], **qwen3_fields(config), "draft_vocab_size": config.draft_vocab_size,
            "target_hidden_size": config.target_hidden_size, "block_size": config.block_size,
            "num_target_layers": config.target_num_layers, "torch_dtype": dtype,
            "dflash_config": {"mask_token_id": config.mask_token_id,
                              "target_layer_ids": list(config.target_layer_ids)}, "eaglekit": marker}


def checkpoint_state(drafter: DFlashDrafter, fmt: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors `fmt` ships: no embedding (the engine shares the target's); the vocabulary mapping only for a
    draft vocabulary smaller than the target's (vLLM has no parameter for it otherwise); t2d for speculators only."""
    state = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    state.pop("embed_tokens.weight")
    if drafter.config.draft_vocab_size == drafter.config.vocab_size or fmt == "vllm":
        state.pop("t2d")
    if drafter.config.draft_vocab_size == drafter.config.vocab_size:
        state.pop("d2t")
    return state


def probe_inputs(drafter: DFlashDrafter, generator: torch.Generator, context_length: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random context (1, T, n_aux * H_target) and block (1, S): an anchor token, then mask tokens."""
    config = drafter.config
    aux = torch.randn(1, context_length, len(config.target_layer_ids) * config.target_hidden_size,
                      generator=generator).to(drafter.fc.weight.dtype)
    ids = torch.full((1, config.block_size), config.mask_token_id)
    ids[0, 0] = int(torch.randint(0, config.vocab_size, (1,), generator=generator))
    return aux, ids


def probe_logits(drafter: DFlashDrafter, seed: int = 0, context_length: int = 7) -> torch.Tensor:
    """Block logits (1, S, Vd) on a fixed random context and block."""
    config = drafter.config
    aux, ids = probe_inputs(drafter, torch.Generator().manual_seed(seed), context_length)
    with torch.no_grad():
        context = drafter.context(aux, torch.arange(context_length)[None])
        return drafter(ids, torch.arange(context_length, context_length + config.block_size)[None], context).float()


IDENTITY = ("target_layer_ids", "mask_token_id", "block_size", "draft_vocab_size")  # kept by a round trip


def compare(reference: DFlashDrafter, candidate: DFlashDrafter, what: str, fields: tuple[str, ...] = IDENTITY,
            probe: Callable[[DFlashDrafter], torch.Tensor] = probe_logits) -> float:
    """Max abs difference of `probe`'s outputs; raises when the two drafters differ in behaviour or identity (the
    config `fields`, the vocabulary mapping)."""
    for name in fields:
        if getattr(reference.config, name) != getattr(candidate.config, name):
            raise EaglekitError(f"{what}: {name} changed on the round trip ({getattr(reference.config, name)} -> "
                                f"{getattr(candidate.config, name)})")
    if not torch.equal(reference.d2t.cpu(), candidate.d2t.cpu()):
        raise EaglekitError(f"{what}: the vocabulary mapping (d2t) changed on the round trip")
    return probe_difference(probe(reference), probe(candidate), reference.fc.weight.dtype, what)


def export_dflash(drafter: DFlashDrafter, output: str | Path, fmt: str = "vllm",
                  dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Write `drafter` in `fmt` to `output`, verified by re-import before the files are moved into place."""
    if fmt not in FORMATS:
        raise EaglekitError(f"a DFlash drafter exports to {' or '.join(FORMATS)}, not {fmt} (SGLang's layout has no "
                            "DFlash drafter): pass --to vllm")
    dtype = dtype or drafter.fc.weight.dtype
    state = checkpoint_state(drafter, fmt, dtype)
    data = engine_config(drafter.config, fmt, DTYPE_NAMES[dtype])
    output = Path(output)
    difference = write_verified(drafter, output, state, data, dtype, import_dflash,
                                lambda reference, reloaded: compare(reference, reloaded, f"{fmt} DFlash export"))
    return {"format": fmt, "drafter_type": "dflash", "output": str(output), "tensors": sorted(state),
            "target_layer_ids": list(drafter.config.target_layer_ids), "mask_token_id": drafter.config.mask_token_id,
            "block_size": drafter.config.block_size, "max_logit_difference": difference, "dtype": DTYPE_NAMES[dtype],
            "embedding_included": False}


# --- import ---------------------------------------------------------------------------------
def _rope(layer: dict[str, Any]) -> dict[str, Any]:
    if isinstance(layer.get("rope_parameters"), dict) and layer["rope_parameters"]:
        rope = dict(layer["rope_parameters"])
        rope.setdefault("rope_theta", float(layer.get("rope_theta", QWEN3_DEFAULT_THETA)))
        rope.setdefault("rope_type", "default")
        return rope
    scaling = dict(layer.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    return {"rope_type": "default", **scaling, "rope_theta": float(layer.get("rope_theta", QWEN3_DEFAULT_THETA))}


def shape_fields(layer: dict[str, Any], data: dict[str, Any], source: Path) -> dict[str, Any]:
    """The DFlashConfig fields of a checkpoint's layers (`layer`: a Qwen3 config dict) and identity (`data`: the
    whole config.json); refuses the variants eaglekit does not implement (sliding-window or causal layers, biases)."""
    if layer.get("layer_types") and any(t != "full_attention" for t in layer["layer_types"]) \
            or (data.get("dflash_config") or {}).get("use_swa") or (data.get("dflash_config") or {}).get("causal"):
        raise EaglekitError(f"{source}: a drafter with sliding-window or causal layers; eaglekit implements the "
                            "standard one (full, non-causal attention in every layer)")
    if layer.get("attention_bias"):
        raise EaglekitError(f"{source}: attention_bias=true; eaglekit's block drafters have no biases")
    hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
    vocab = int(layer["vocab_size"])
    marker = data.get("eaglekit") or {}
    return dict(
        hidden_size=hidden, intermediate_size=int(layer["intermediate_size"]), num_attention_heads=heads,
        num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
        num_hidden_layers=int(layer["num_hidden_layers"]), vocab_size=vocab,
        draft_vocab_size=int(data.get("draft_vocab_size") or vocab),
        target_hidden_size=int(data.get("target_hidden_size") or hidden),
        head_dim=layer.get("head_dim") or hidden // heads,
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)), rope_parameters=_rope(layer),
        max_position_embeddings=int(layer.get("max_position_embeddings", 4096)),
        hidden_act=str(layer.get("hidden_act", "silu")),
        target_name_or_path=str(marker.get("target_name_or_path", "")),
        target_architecture=str(marker.get("target_architecture", "")),
        target_weights_hash=str(marker.get("target_weights_hash", "")),
        target_num_layers=int(data.get("num_target_layers") or 0))


def config_from(data: dict[str, Any], source: Path) -> DFlashConfig:
    """A DFlashConfig from a vLLM-layout or speculators-layout config.json."""
    if data.get("speculators_model_type") == "dflash":
        layer = dict(data.get("transformer_layer_config") or {})
        target_ids = [int(i) - 1 for i in data.get("aux_hidden_state_layer_ids") or []]
        mask_id, block_size = data.get("mask_token_id"), data.get("block_size", DEFAULT_BLOCK_SIZE)
        if data.get("sample_from_anchor"):
            raise EaglekitError(f"{source}: sample_from_anchor=true drafts from the anchor position, which vLLM "
                                "refuses for DFlash; read it as a DSpark drafter (its layout) instead")
    else:
        layer = data
        dflash = data.get("dflash_config") or {}
        target_ids = list(dflash.get("target_layer_ids") or [])
        mask_id, block_size = dflash.get("mask_token_id", data.get("mask_token_id")), data.get("block_size", 16)
    if not target_ids or mask_id is None:
        raise EaglekitError(f"{source}/config.json names no target layers or mask_token_id (dflash_config."
                            "target_layer_ids, dflash_config.mask_token_id): not a DFlash drafter eaglekit can read")
    return DFlashConfig(**shape_fields(layer, data, source), target_layer_ids=tuple(target_ids),
                        mask_token_id=int(mask_id), block_size=int(block_size))


def checkpoint_tensors(source: Path, config: DFlashConfig, lm_head: torch.Tensor | None = None) -> dict[str, Any]:
    """A block drafter checkpoint's tensors under eaglekit's names: no `model.` prefix, the vocabulary mapping
    completed (d2t, t2d), a missing lm_head the target's (`lm_head`, else zeros until `load_target_lm_head`), float."""
    state = {k.removeprefix("model."): v for k, v in read_weights(source).items()}
    state.pop("t2d", None)
    if "d2t" not in state:
        if config.draft_vocab_size != config.vocab_size:
            raise EaglekitError(f"{source}: draft_vocab_size {config.draft_vocab_size} without a d2t mapping")
        state["d2t"] = torch.zeros(config.vocab_size, dtype=torch.long)
    if "lm_head.weight" not in state:  # it drafts with the target's: given, else zeros until `load_target_lm_head`
        state["lm_head.weight"] = (lm_head.detach().cpu().float() if lm_head is not None
                                   else torch.zeros(config.draft_vocab_size, config.hidden_size))
    d2t = state["d2t"].long()
    state["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool)
    state["t2d"][torch.arange(config.draft_vocab_size) + d2t] = True
    state["d2t"] = d2t
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


def import_dflash(source: str | Path, lm_head: torch.Tensor | None = None) -> DFlashDrafter:
    """Read a DFlash checkpoint (vLLM or speculators layout, or eaglekit's own). A checkpoint without
    `lm_head.weight` drafts with the target's: pass it as `lm_head` (V, H), else it stays zero (`load_target_lm_head`
    fills it)."""
    source = Path(source)
    data = read_config(source)
    if data.get("format") == "eaglekit-dflash":
        return DFlashDrafter.from_pretrained(source)
    config = config_from(data, source)
    state = checkpoint_tensors(source, config, lm_head)
    return build_from_state(config, state, str(source))


def check_import_target(drafter: DFlashDrafter, source: Path, options: Any) -> dict[str, Any]:
    """A block drafter read for `eaglekit import`, checked against the target of `options` -> its config dict made to
    record that target (it must have an lm_head: its own, or the target's)."""
    if not bool(drafter.lm_head.weight.any()):
        raise EaglekitError(f"{source} has no lm_head: it drafts with the target's, so pass target=MODEL")
    data = drafter.config.to_dict()
    layers = options.target_num_layers
    if options.target_name:
        if layers and max(drafter.config.target_layer_ids) >= layers:
            raise EaglekitError(f"target_layer_ids {list(drafter.config.target_layer_ids)} exceed the target's "
                                f"{layers} layers: wrong target?")
        data.update(target_name_or_path=options.target_name,
                    target_architecture=options.target_architecture or data["target_architecture"],
                    target_num_layers=layers or data["target_num_layers"])
    return data


def import_for_target(source: Path, output: Path, options: Any) -> tuple[DFlashDrafter, dict[str, Any], str]:
    """`eaglekit import` of a DFlash checkpoint (vLLM's or speculators' layout; a published z-lab checkpoint has no
    lm_head: it drafts with the target's, `options.lm_head`) -> (drafter, summary fields, the line to print)."""
    if options.aux_layer_ids:
        raise EaglekitError("aux_layer_ids= overrides EAGLE-3 layers; a DFlash checkpoint names its own "
                            "target_layer_ids: drop aux_layer_ids")
    head = options.lm_head() if options.lm_head is not None else None
    drafter = import_dflash(source, lm_head=head)
    drafter.config = DFlashConfig.from_dict(check_import_target(drafter, source, options))
    summary = {"drafter_type": "dflash", "target_layer_ids": list(drafter.config.target_layer_ids),
               "block_size": drafter.config.block_size, "mask_token_id": drafter.config.mask_token_id,
               "draft_vocab_size": drafter.config.draft_vocab_size, "lm_head_from_target": head is not None}
    message = (f"imported DFlash drafter {source} -> {output}; target layers (output-of-layer) "
               f"{summary['target_layer_ids']}, block {summary['block_size']}")
    return drafter, summary, message


def export_note(summary: dict[str, Any], source: Path, output: Path) -> str:
    """What `eaglekit export` prints of a DFlash export."""
    return (f"exported {source} -> {output} ({summary['format']}, DFlash); target_layer_ids (output-of-layer) "
            f"{summary['target_layer_ids']}, mask token {summary['mask_token_id']}, block {summary['block_size']}; "
            "re-import matched the source logits")
