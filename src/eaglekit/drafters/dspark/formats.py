"""DSpark drafters in the engines' layouts: export to vLLM's / DeepSpec's (`Qwen3DSparkModel`) and speculators' 0.9
(`speculators_model_type: dspark`), import either back (a DeepSpec DFlash checkpoint is the same class with
`markov_rank` 0), with a logit check on every export.

vLLM 0.32 (`Qwen3DSparkForCausalLM`, vllm/model_executor/models/qwen3_dspark.py) reads a flat Qwen3 config.json with
`architectures: ["Qwen3DSparkModel"]`, `model_type: "qwen3"` and the top-level keys `block_size`, `mask_token_id`,
`target_layer_ids` (output-of-layer ids; vLLM captures input-of-layer id + 1), `markov_rank` (required),
`markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov` (both False when absent),
`sample_from_anchor` (True when absent), `draft_vocab_size`; tensors `fc`, `hidden_norm`, `layers.{i}.*`, `norm`,
`markov_head.markov_w1.weight` (V, r), `markov_head.markov_w2.weight` (Vd, r), `confidence_head.proj.{weight,bias}`,
`lm_head.weight` (required for a draft vocabulary smaller than the target's, with `d2t` offsets), optional
`embed_tokens.weight`. Its loader knows the vanilla Markov head only (a gated or rnn head's tensors are refused).
speculators 0.9 (`speculators.models.dspark.DSparkDraftModel`) holds the same tensors (every head) under a
`transformer_layer_config`, with `aux_hidden_state_layer_ids` in the input-of-layer convention and `t2d`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eaglekit.drafters.dflash.formats import (
    IDENTITY,
    check_import_target,
    checkpoint_state,
    checkpoint_tensors,
    probe_inputs,
    qwen3_fields,
    shape_fields,
)
from eaglekit.drafters.dflash.formats import compare as dflash_compare
from eaglekit.drafters.dflash.model import build_from_state
from eaglekit.drafters.dspark.model import DEFAULT_BLOCK_SIZE, DSparkConfig, DSparkDrafter
from eaglekit.errors import EaglekitError
from eaglekit.formats.export import write_verified
from eaglekit.formats.files import DTYPE_NAMES, read_config, verifier_path

FORMATS = ("vllm", "speculators")
ARCHITECTURE = "Qwen3DSparkModel"  # vLLM's and DeepSpec's
SPECULATORS_ARCHITECTURE = "DSparkDraftModel"
HEADS = ("markov_rank", "markov_head_type", "confidence_head", "confidence_head_with_markov", "sample_from_anchor",
         "confidence_temperatures")  # kept by a round trip, beside DFlash's IDENTITY
VLLM_MARKOV_HEADS = ("vanilla",)  # what vLLM 0.32's loader has parameters for


def is_dspark_checkpoint(data: dict[str, Any]) -> bool:
    """True for a config.json of a DSpark drafter in vLLM's/DeepSpec's or speculators' layout."""
    architectures = data.get("architectures") or []
    return (ARCHITECTURE in architectures or data.get("speculators_model_type") == "dspark"
            or (SPECULATORS_ARCHITECTURE in architectures and data.get("model_type") == "qwen3"))


def check_exportable(config: DSparkConfig, fmt: str) -> None:
    """Refuse a layout that cannot hold this drafter (vLLM 0.32 loads the vanilla Markov head only)."""
    if fmt == "vllm" and config.markov_rank > 0 and config.markov_head_type not in VLLM_MARKOV_HEADS:
        raise EaglekitError(f"vLLM 0.32 loads only the vanilla Markov head (its Qwen3DSparkForCausalLM has no "
                            f"parameter for a {config.markov_head_type} head's tensors): export this drafter --to "
                            "speculators (speculators 0.9 reads every head), or train markov_head_type=vanilla")


# --- export ---------------------------------------------------------------------------------
def engine_config(config: DSparkConfig, fmt: str, dtype: str) -> dict[str, Any]:
    """config.json of `fmt` for `config` (eaglekit's calibration rides along under `eaglekit`)."""
    marker = {"target_name_or_path": config.target_name_or_path, "target_architecture": config.target_architecture,
              "target_weights_hash": config.target_weights_hash,
              "confidence_temperatures": list(config.confidence_temperatures)}
    layer = {**qwen3_fields(config), "layer_types": ["full_attention"] * config.num_hidden_layers}
    heads = {"markov_rank": config.markov_rank, "markov_head_type": config.markov_head_type,
             "enable_confidence_head": config.confidence_head,
             "confidence_head_with_markov": config.confidence_head_with_markov,
             "sample_from_anchor": config.sample_from_anchor, "block_size": config.block_size,
             "mask_token_id": config.mask_token_id, "draft_vocab_size": config.draft_vocab_size,
             "target_hidden_size": config.target_hidden_size}
    if fmt == "speculators":
        return {"architectures": [SPECULATORS_ARCHITECTURE], "speculators_model_type": "dspark",
                "transformer_layer_config": layer, **heads,
                "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
                "sliding_window_non_causal": False, "num_target_layers": config.target_num_layers,
                "torch_dtype": dtype, "eaglekit": marker,
                "speculators_config": {
                    "algorithm": "dspark", "default_proposal_method": "greedy",
                    "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.max_drafts}],
                    "verifier": {"name_or_path": verifier_path(config.target_name_or_path),
                                 "architectures": [config.target_architecture] if config.target_architecture else []}}}
    return {"architectures": [ARCHITECTURE], **layer, **heads, "target_layer_ids": list(config.target_layer_ids),
            "num_target_layers": config.target_num_layers, "torch_dtype": dtype, "eaglekit": marker}


def probe_outputs(drafter: DSparkDrafter, seed: int = 0, context_length: int = 7) -> torch.Tensor:
    """(1, K, Vd + 1) on a fixed random context, block and previous tokens: the Markov-corrected logits of every
    drafted position and its raw confidence logit (0 without a confidence head)."""
    config = drafter.config
    generator = torch.Generator().manual_seed(seed)
    aux, ids = probe_inputs(drafter, generator, context_length)
    prev = torch.randint(0, config.vocab_size, (1, config.max_drafts), generator=generator)
    with torch.no_grad():
        context = drafter.context(aux, torch.arange(context_length)[None])
        positions = torch.arange(context_length, context_length + config.block_size)[None]
        hidden = drafter.hidden_states(ids, positions, context)[:, config.first_slot :]  # (1, K, H)
        logits, e = drafter.markov_logits(hidden, prev)
        confidence = drafter.confidence_logits(hidden, e)
    confidence = torch.zeros(logits.shape[:-1]) if confidence is None else confidence
    return torch.cat([logits.float(), confidence[..., None].float()], -1)


def compare(reference: DSparkDrafter, candidate: DSparkDrafter, what: str) -> float:
    """Max abs probe difference (logits and confidences); raises when the two drafters differ in behaviour or
    identity (DFlash's fields and the heads')."""
    return dflash_compare(reference, candidate, what, (*IDENTITY, *HEADS), probe_outputs)


def export_dspark(drafter: DSparkDrafter, output: str | Path, fmt: str = "vllm",
                  dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Write `drafter` in `fmt` to `output`, verified by re-import before the files are moved into place."""
    check_exportable(drafter.config, fmt)
    dtype = dtype or drafter.fc.weight.dtype
    state = checkpoint_state(drafter, fmt, dtype)
    data = engine_config(drafter.config, fmt, DTYPE_NAMES[dtype])
    output = Path(output)
    difference = write_verified(drafter, output, state, data, dtype, import_dspark,
                                lambda reference, reloaded: compare(reference, reloaded, f"{fmt} DSpark export"))
    config = drafter.config
    return {"format": fmt, "drafter_type": "dspark", "output": str(output), "tensors": sorted(state),
            "target_layer_ids": list(config.target_layer_ids), "mask_token_id": config.mask_token_id,
            "block_size": config.block_size, "markov_rank": config.markov_rank,
            "markov_head_type": config.markov_head_type, "max_drafts": config.max_drafts,
            "max_logit_difference": difference, "dtype": DTYPE_NAMES[dtype], "embedding_included": False}


def export_note(summary: dict[str, Any], source: Path, output: Path) -> str:
    """What `eaglekit export` prints of a DSpark export."""
    note = (f"exported {source} -> {output} ({summary['format']}, DSpark, {summary['markov_head_type']} Markov head "
            f"of rank {summary['markov_rank']}); target_layer_ids (output-of-layer) {summary['target_layer_ids']}, "
            f"block {summary['block_size']}; re-import matched the source logits and confidences")
    if summary["format"] == "vllm":
        note += "\nvLLM's GPU model runner serves it; vLLM's CPU build does not run DSpark"
    return note


# --- import ---------------------------------------------------------------------------------
def config_from(data: dict[str, Any], source: Path) -> DSparkConfig:
    """A DSparkConfig from a vLLM/DeepSpec-layout or speculators-layout config.json, with each reader's defaults for
    keys it leaves out (vLLM: no confidence head, anchor-first; speculators: DSparkSpeculatorConfig's)."""
    marker = data.get("eaglekit") or {}
    if data.get("speculators_model_type") == "dspark":
        layer = dict(data.get("transformer_layer_config") or {})
        target_ids = [int(i) - 1 for i in data.get("aux_hidden_state_layer_ids") or []]
        defaults = {"markov_rank": 256, "markov_head_type": "vanilla", "enable_confidence_head": True,
                    "confidence_head_with_markov": True, "sample_from_anchor": True}
    else:
        layer = data
        target_ids = list(data.get("target_layer_ids") or [])
        defaults = {"markov_head_type": "vanilla", "enable_confidence_head": False,
                    "confidence_head_with_markov": False, "sample_from_anchor": True}
        if "markov_rank" not in data:
            raise EaglekitError(f"{source}/config.json has no markov_rank, which vLLM requires of a DSpark drafter "
                                "(0 for a DFlash drafter in this layout): add it")
    mask_id = data.get("mask_token_id")
    if not target_ids or mask_id is None:
        raise EaglekitError(f"{source}/config.json names no target layers or mask_token_id: not a DSpark drafter "
                            "eaglekit can read")
    value = {**defaults, **{k: data[k] for k in defaults if k in data}}
    rank = int(data.get("markov_rank", defaults.get("markov_rank", 0)))
    confidence = bool(value["enable_confidence_head"])
    with_markov = confidence and rank > 0 and bool(value["confidence_head_with_markov"])
    return DSparkConfig(**shape_fields(layer, data, source), target_layer_ids=tuple(target_ids),
                        mask_token_id=int(mask_id), block_size=int(data.get("block_size", DEFAULT_BLOCK_SIZE)),
                        markov_rank=rank, markov_head_type=str(value["markov_head_type"]), confidence_head=confidence,
                        confidence_head_with_markov=with_markov,
                        sample_from_anchor=bool(value["sample_from_anchor"]),
                        confidence_temperatures=tuple(marker.get("confidence_temperatures") or ()))


def import_dspark(source: str | Path, lm_head: torch.Tensor | None = None) -> DSparkDrafter:
    """Read a DSpark checkpoint (vLLM/DeepSpec or speculators layout, or eaglekit's own). A checkpoint without
    `lm_head.weight` drafts with the target's: pass it as `lm_head` (V, H), else it stays zero."""
    source = Path(source)
    data = read_config(source)
    if data.get("format") == DSparkDrafter.FORMAT:
        return DSparkDrafter.from_pretrained(source)
    config = config_from(data, source)
    state = checkpoint_tensors(source, config, lm_head)
    if config.confidence_head and "confidence_head.proj.weight" not in state:
        raise EaglekitError(f"{source}: config.json enables the confidence head but the checkpoint has no "
                            "confidence_head.proj tensors: set enable_confidence_head to false, or add them")
    return build_from_state(config, state, str(source), DSparkDrafter)


def import_for_target(source: Path, output: Path, options: Any) -> tuple[DSparkDrafter, dict[str, Any], str]:
    """`eaglekit import` of a DSpark checkpoint -> (drafter, summary fields, the line to print)."""
    if options.aux_layer_ids:
        raise EaglekitError("aux_layer_ids= overrides EAGLE-3 layers; a DSpark checkpoint names its own "
                            "target_layer_ids: drop aux_layer_ids")
    head = options.lm_head() if options.lm_head is not None else None
    drafter = import_dspark(source, lm_head=head)
    drafter.config = DSparkConfig.from_dict(check_import_target(drafter, source, options))
    config = drafter.config
    summary = {"drafter_type": "dspark", "target_layer_ids": list(config.target_layer_ids),
               "block_size": config.block_size, "markov_rank": config.markov_rank,
               "markov_head_type": config.markov_head_type, "confidence_head": config.confidence_head,
               "sample_from_anchor": config.sample_from_anchor, "draft_vocab_size": config.draft_vocab_size,
               "lm_head_from_target": head is not None}
    message = (f"imported DSpark drafter {source} -> {output}; target layers (output-of-layer) "
               f"{summary['target_layer_ids']}, block {config.block_size}, {config.markov_head_type} Markov head of "
               f"rank {config.markov_rank}")
    return drafter, summary, message
