"""Export an eaglekit drafter to an engine layout and import engine layouts back, with a logit check.

`export_drafter` checks the drafter can be served as is, writes the checkpoint into a temporary
directory, re-reads it with `import_checkpoint` and compares logits on a fixed probe input before
moving the files into place. `import_checkpoint` turns any supported layout into an `Eagle3Drafter`.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from eaglekit.drafters.eagle3.config import DrafterConfig
from eaglekit.drafters.eagle3.model import Eagle3Drafter
from eaglekit.layers import INPUT_OF_LAYER
from eaglekit.errors import EaglekitError
from eaglekit.formats import files
from eaglekit.formats.export import write_verified
from eaglekit.drafters.eagle3 import formats, mla_format
from eaglekit.targets.capture import engine_aux_layers, to_input_convention

log = logging.getLogger(__name__)
# warnings about a drafter's aux layers logged by this process: `eaglekit run` exports one drafter in every format,
# and the warning, the same for each, is said once (each export's summary still lists it)
LOGGED_WARNINGS: set[str] = set()


# --- probe ----------------------------------------------------------------------------------
def probe_logits(drafter: Eagle3Drafter, seed: int = 0, length: int = 8) -> torch.Tensor:
    """Draft logits (1, T, Vd) on a fixed random input: fused aux states, next tokens, causal mask."""
    config = drafter.config
    generator = torch.Generator().manual_seed(seed)
    dtype = drafter.fc.weight.dtype
    aux = torch.randn(1, length, 3 * config.target_hidden_size, generator=generator).to(dtype)  # (1, T, 3H)
    input_ids = torch.randint(0, config.vocab_size, (1, length), generator=generator)  # (1, T)
    position_ids = torch.arange(length)[None]  # (1, T)
    mask = torch.ones(length, length, dtype=torch.bool).tril()[None, None]  # (1, 1, T, T)
    with torch.no_grad():
        _, logits, _ = drafter(drafter.fuse(aux), input_ids, position_ids, mask=mask)
    return logits.float()


def compare_drafters(reference: Eagle3Drafter, candidate: Eagle3Drafter, what: str) -> float:
    """Max abs logit difference on the probe; raises when the drafters differ in behaviour."""
    if (not torch.equal(reference.d2t.cpu(), candidate.d2t.cpu())
            or not torch.equal(reference.t2d.cpu(), candidate.t2d.cpu())):
        raise EaglekitError(f"{what}: the vocabulary mapping (d2t/t2d) changed on the round trip")
    ref_ids = to_input(reference.config)
    if ref_ids != to_input(candidate.config):
        raise EaglekitError(f"{what}: aux layers changed on the round trip ({ref_ids} -> {to_input(candidate.config)})")
    parallel = [(c.drafter_type, c.mask_token_id) for c in (reference.config, candidate.config)]
    if parallel[0] != parallel[1] or (parallel[0][0] == "p-eagle"
                                      and not torch.equal(reference.mask_hidden.cpu(), candidate.mask_hidden.cpu())):
        raise EaglekitError(f"{what}: the parallel drafting (drafter type, mask token, mask_hidden) changed on the "
                            f"round trip ({parallel[0]} -> {parallel[1]})")
    return files.probe_difference(probe_logits(reference), probe_logits(candidate), reference.fc.weight.dtype, what)


def to_input(config: DrafterConfig) -> tuple[int, ...]:
    return tuple(to_input_convention(config.aux_layer_ids, config.aux_layer_convention))


# --- export ---------------------------------------------------------------------------------
def _export_state(drafter: Eagle3Drafter, dtype: torch.dtype, include_embedding: bool) -> dict[str, torch.Tensor]:
    state = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    embedding = state.get("embed_tokens.weight")
    if not include_embedding or embedding is None or not bool(embedding.any()):
        if include_embedding and embedding is not None:
            log.warning("the drafter's embedding is all zeros (never loaded): leaving it out, the "
                        "engine uses the target's")
        state.pop("embed_tokens.weight", None)
    if drafter.config.draft_vocab_size == drafter.config.vocab_size:
        # the full vocabulary: d2t is all zeros (identity), and vLLM's eagle3 loader has no parameter to put it in
        # ("There is no module or parameter named 'draft_id_to_target_id'", vLLM 0.32), so leave the mapping out
        assert "d2t" not in state or not bool(state["d2t"].any()), "a full draft vocabulary maps every id to itself"
        state.pop("d2t", None)
        state.pop("t2d", None)
    return state


def export_drafter(drafter: Eagle3Drafter, output: str | Path, fmt: str, dtype: torch.dtype | None = None,
                   include_embedding: bool = True, speculative_tokens: int = 3) -> dict[str, Any]:
    """Write `drafter` in `fmt` to `output`; returns a summary. Verified by re-import before it is kept."""
    config = drafter.config
    formats.check_exportable(config, fmt)
    dtype = dtype or drafter.fc.weight.dtype
    state = formats.to_checkpoint_state(_export_state(drafter, dtype, include_embedding), fmt)
    formats.check_required(fmt, config, state)
    data = formats.engine_config(config, fmt, files.DTYPE_NAMES[dtype], speculative_tokens)
    output = Path(output)
    difference = write_verified(drafter, output, state, data, dtype, lambda staged: import_checkpoint(staged, fmt),
                                lambda reference, reloaded: compare_drafters(reference, reloaded, f"{fmt} export"))
    input_ids = list(to_input(config))
    warnings = []
    if config.target_num_layers and tuple(input_ids) != engine_aux_layers(config.target_num_layers):
        warnings.append(f"aux layers {input_ids} are not the engine default "
                        f"{list(engine_aux_layers(config.target_num_layers))}: engine releases that ignore the "
                        "drafter's explicit ids (vLLM 0.11, see `eaglekit doctor`) will feed it other layers")
        if warnings[-1] not in LOGGED_WARNINGS:
            LOGGED_WARNINGS.add(warnings[-1])
            log.warning(warnings[-1])
    return {"warnings": warnings, "format": fmt, "output": str(output), "tensors": sorted(state),
            "config_aux_layer_ids": _written_ids(data),
            "aux_layer_ids_input_of_layer": input_ids, "max_logit_difference": difference,
            "dtype": files.DTYPE_NAMES[dtype], "embedding_included": "embed_tokens.weight" in state}


def _written_ids(data: dict[str, Any]) -> list[int]:
    if "eagle_config" in data:
        return list(data["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    return list(data["eagle_aux_hidden_state_layer_ids"])


# --- import ---------------------------------------------------------------------------------
def _aux_ids(data: dict[str, Any], layout: str, from_format: str,
             target_num_layers: int | None) -> tuple[tuple[int, ...], str]:
    """(ids, convention) from a config dict; never guesses an ambiguous convention."""
    marker = data.get(formats.MARKER) or {}
    if marker.get("aux_layer_ids_input_of_layer"):
        return tuple(marker["aux_layer_ids_input_of_layer"]), INPUT_OF_LAYER
    if layout == "speculators":
        ids, convention = data.get("eagle_aux_hidden_state_layer_ids"), INPUT_OF_LAYER
    else:
        nested = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        top = data.get("eagle_aux_hidden_state_layer_ids")
        ids = top or nested
        if ids and from_format == "auto":
            if top and not nested:
                from_format = "vllm"  # only vLLM reads the top-level key
            else:
                raise EaglekitError(f"the checkpoint names aux layers {list(ids)} in eagle_config, which vLLM reads as "
                                    "input-of-layer ids and SGLang as output-of-layer ids (one "
                                    "apart). Say which engine it was made for: from_format=vllm, from_format=sglang "
                                    "or from_format=eagle")
        convention = formats.CONVENTION.get(from_format, INPUT_OF_LAYER)
    if ids:
        return tuple(int(i) for i in ids), convention
    layers = target_num_layers or marker.get("target_num_layers")
    if not layers:
        raise EaglekitError("the checkpoint does not name its aux layers, so the engine default (2, "
                            "L/2, L-3) applies and needs the target's layer count: pass target=<model dir, "
                            "config.json or hub id>")
    return engine_aux_layers(int(layers)), INPUT_OF_LAYER


def _check_supported(llama: dict[str, Any], data: dict[str, Any]) -> None:
    eagle = data.get("eagle_config") or {}
    problems = []
    if int(llama.get("num_hidden_layers", 1)) != 1:
        problems.append(f"num_hidden_layers={llama['num_hidden_layers']}")
    if llama.get("attention_bias") or llama.get("mlp_bias"):
        problems.append("biases")
    if eagle.get("use_aux_hidden_state") is False:
        problems.append("use_aux_hidden_state=false (an EAGLE-1/2 drafter)")
    if problems:
        raise EaglekitError(f"drafter uses {', '.join(problems)}, which eaglekit's drafter does not implement")


def variant_flags(data: dict[str, Any]) -> dict[str, bool]:
    """norm_before_fc / fc_norm / norm_output where the engines read them: `norm_before_fc` from `eagle_config` or
    the top level (vLLM, SGLang), `fc_norm` from the top level or SGLang's legacy `use_aux_norm`, `norm_output`
    from the top level; speculators keeps all three at the top level."""
    eagle = data.get("eagle_config") or {}
    return {"norm_before_fc": bool(eagle.get("norm_before_fc", data.get("norm_before_fc", False))),
            "fc_norm": bool(data.get("fc_norm") or data.get("use_aux_norm", False)),
            "norm_output": bool(data.get("norm_output", False))}


def drafter_config_from(data: dict[str, Any], layout: str, from_format: str = "auto",
                        target_num_layers: int | None = None) -> DrafterConfig:
    """DrafterConfig from a speculators or eagle3-layout config dict."""
    llama = data["transformer_layer_config"] if layout == "speculators" else data
    _check_supported(llama, data)
    ids, convention = _aux_ids(data, layout, from_format, target_num_layers)
    ids, convention = to_input_convention(ids, convention), INPUT_OF_LAYER  # eaglekit keeps input-of-layer ids
    marker = data.get(formats.MARKER) or {}
    verifier = (data.get("speculators_config") or {}).get("verifier") or {}
    hidden = int(llama["hidden_size"])
    try:
        return DrafterConfig(
            hidden_size=hidden, intermediate_size=int(llama["intermediate_size"]),
            num_attention_heads=int(llama["num_attention_heads"]),
            num_key_value_heads=int(llama.get("num_key_value_heads") or llama["num_attention_heads"]),
            head_dim=llama.get("head_dim"), vocab_size=int(llama["vocab_size"]),
            draft_vocab_size=int(data.get("draft_vocab_size") or llama["vocab_size"]),
            target_hidden_size=int(data.get("target_hidden_size") or hidden),
            aux_layer_ids=ids, aux_layer_convention=convention,
            rms_norm_eps=float(llama.get("rms_norm_eps", 1e-6)), rope_parameters=formats._rope_from(llama),
            max_position_embeddings=int(llama.get("max_position_embeddings", 4096)),
            hidden_act=llama.get("hidden_act", "silu"),
                             norm_before_residual=bool(data.get("norm_before_residual", False)),
            target_name_or_path=marker.get("target_name_or_path") or verifier.get("name_or_path") or "",
            target_architecture=marker.get("target_architecture") or (verifier.get("architectures") or [""])[0],
            target_num_layers=int(target_num_layers or marker.get("target_num_layers") or 0),
            target_weights_hash=str(marker.get("target_weights_hash") or ""),
            **variant_flags(data), **mla_format.drafter_fields(data),
        )
    except KeyError as error:
        raise EaglekitError(f"drafter config lacks {error.args[0]!r}") from None


def import_checkpoint(source: str | Path, from_format: str = "auto", target_num_layers: int | None = None,
                      aux_layer_ids: tuple[int, ...] | None = None) -> Eagle3Drafter:
    """Load an EAGLE / vLLM / SGLang / speculators drafter checkpoint as an `Eagle3Drafter`."""
    if from_format not in formats.IMPORT_FORMATS:
        raise EaglekitError(f"unknown from_format '{from_format}'; use one of {', '.join(formats.IMPORT_FORMATS)}")
    source = Path(source)
    data = files.read_config(source)
    layout = formats.detect_format(data)
    if layout == "eaglekit":
        raise EaglekitError(f"{source} is already an eaglekit drafter; load it with Eagle3Drafter.from_pretrained")
    if (layout == "speculators") != (from_format == "speculators") and from_format != "auto":
        raise EaglekitError(f"{source} is a {layout} checkpoint, not {from_format}; use from_format=auto")
    config = drafter_config_from(data, layout, from_format, target_num_layers)
    if aux_layer_ids:
        config = DrafterConfig.from_dict({**config.to_dict(), "aux_layer_ids": list(aux_layer_ids),
                                          "aux_layer_convention": INPUT_OF_LAYER})
    weights = mla_format.engine_names(files.read_weights(source), data)  # an MLA drafter's layers.0. -> midlayer.
    state = formats.from_checkpoint_state(weights, "speculators" if layout == "speculators" else "vllm")
    parallel = formats.parallel_fields(data, state)  # P-EAGLE: mask_hidden and its token id
    if parallel:
        config = dataclasses.replace(config, **parallel)
        state = {**state, "mask_hidden": state["mask_hidden"].reshape(1, -1)}  # speculators: (1, 1, n)
    return _build(config, state, source)


def read_checkpoint(source: Path, options: Any) -> Eagle3Drafter:
    """An engine-layout checkpoint as an `Eagle3Drafter` (`options`: `eaglekit.formats.saved.ImportOptions`)."""
    return import_checkpoint(source, options.from_format, options.target_num_layers, options.aux_layer_ids or None)


def import_for_target(source: Path, output: Path, options: Any) -> tuple[Eagle3Drafter, dict[str, Any], str]:
    """`eaglekit import`: the checkpoint as an `Eagle3Drafter` that records its target (`options.target_name`),
    checked against the target's layers -> (drafter, summary fields, the line to print)."""
    drafter = read_checkpoint(source, options)
    data = drafter.config.to_dict()
    layers = options.target_num_layers
    if options.target_name:
        data.update(target_name_or_path=options.target_name,
                    target_architecture=options.target_architecture or data["target_architecture"])
        if layers and max(drafter.config.aux_layer_ids) > layers:
            raise EaglekitError(
                f"aux layer ids {drafter.config.aux_layer_ids} exceed the target's {layers} layers: wrong target?"
            )
    drafter.config = DrafterConfig.from_dict(data)
    summary = {"aux_layer_ids": list(drafter.config.aux_layer_ids),
               "aux_layer_convention": drafter.config.aux_layer_convention,
               "draft_vocab_size": drafter.config.draft_vocab_size,
               "has_embedding": bool(drafter.embed_tokens.weight.any())}
    message = (f"imported {source} -> {output}; aux layers (input-of-layer) {summary['aux_layer_ids']}"
               + ("" if summary["has_embedding"] else "; no embedding in the checkpoint: load the target's before use"))
    return drafter, summary, message


def export_note(summary: dict[str, Any], source: Path, output: Path) -> str:
    """What `eaglekit export` prints of an EAGLE-3 export."""
    return (f"exported {source} -> {output} ({summary['format']}); aux layer ids written: "
            f"{summary['config_aux_layer_ids']} (input-of-layer: {summary['aux_layer_ids_input_of_layer']}); "
            "re-import matched the source logits")


def _build(config: DrafterConfig, state: dict[str, torch.Tensor], source: Path) -> Eagle3Drafter:
    drafter = Eagle3Drafter(config)
    expected = drafter.state_dict()
    missing = sorted(set(expected) - set(state) - {"embed_tokens.weight", "d2t", "t2d"})
    if missing:
        raise EaglekitError(f"{source}: missing tensors {missing}")
    extra = sorted(set(state) - set(expected))
    if extra:  # e.g. input_norm.weight without norm_before_fc: the engines would build the drafter without it
        raise EaglekitError(f"{source}: tensors {extra} belong to a drafter variant its config.json does not enable "
                            f"(flags {', '.join(formats.VARIANT_FLAGS)}); set the flag there, or remove the tensors")
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise EaglekitError(f"{source}: tensor {key} has shape {tuple(tensor.shape)}, the config implies "
                                f"{tuple(expected[key].shape)}")
    dtype = state["fc.weight"].dtype
    if "embed_tokens.weight" not in state:  # the engine shares the target's: zero = "not loaded" (see from_pretrained)
        state = {**state, "embed_tokens.weight": torch.zeros_like(expected["embed_tokens.weight"])}
    drafter.load_state_dict(state, strict=False)
    if "d2t" in state and "t2d" not in state:  # rebuild the mask from the offsets
        drafter.set_vocab_mapping(state["d2t"] + torch.arange(config.draft_vocab_size))
    elif "d2t" not in state:
        if config.draft_vocab_size != config.vocab_size:
            raise EaglekitError(f"{source}: draft vocabulary {config.draft_vocab_size} < target "
                                f"{config.vocab_size} but no d2t mapping")
        drafter.set_vocab_mapping(torch.arange(config.vocab_size))
    return drafter.to(dtype)
