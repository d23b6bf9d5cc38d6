"""Drafter checkpoint layouts of the serving engines, with explicit key maps both ways.

Layouts (checked against the engines' source: vLLM `model_executor/models/llama_eagle3.py` and
`v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`, SGLang `srt/models/llama_eagle3.py` and
`model_runner_components/spec_aux_hidden_state.py`, speculators 0.9 `models/eagle3/`):

- "eagle3" layout (EAGLE, vLLM, SGLang): a LlamaConfig with `architectures: [LlamaForCausalLMEagle3]`,
  tensors `midlayer.*`, `fc.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`, optional
  `embed_tokens.weight`. The aux layer ids differ by engine:
    vLLM reads the TOP-LEVEL `eagle_aux_hidden_state_layer_ids` (input-of-layer ids, ours as is);
    SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` as output-of-layer ids (ours - 1).
- speculators: `speculators_model_type: eagle3`, a nested `transformer_layer_config`, tensors under
  `layers.0.*`, input-of-layer ids in `eagle_aux_hidden_state_layer_ids`.

Drafter variants (`eaglekit.drafters.eagle3.model`): `input_norm.weight` (norm_before_fc) and `fc_norm.{i}.weight`
(fc_norm) are top-level tensors in every layout. The flags: vLLM 0.32 and SGLang 0.5.23 read `norm_before_fc`
from `eagle_config` or the top level, `fc_norm` (SGLang also the legacy `use_aux_norm`) and `norm_output` from
the top level; speculators holds all three at the top level of its config. Exports write them in both places
where an engine looks; a flag left out makes both engines build the drafter without it (and skip its norm
tensors silently), hence the required-key check.

Every export records `eaglekit_export` (format and id convention) in its config so that import
never has to guess which engine's convention the ids use.
"""

from __future__ import annotations

from typing import Any

import torch

from eaglekit.drafters.eagle3.config import DrafterConfig
from eaglekit.layers import INPUT_OF_LAYER, OUTPUT_OF_LAYER
from eaglekit.errors import EaglekitError
from eaglekit.formats.files import verifier_path
from eaglekit.drafters.eagle3 import mla_format
from eaglekit.formats.names import EXPORT_FORMATS, IMPORT_FORMATS  # noqa: F401 (convert.py reads formats.IMPORT_FORMATS)
from eaglekit.targets.capture import from_input_convention, to_input_convention

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"  # the default of speculators' Eagle3SpeculatorConfig
MARKER = "eaglekit_export"
CONVENTION = {"vllm": INPUT_OF_LAYER, "eagle": INPUT_OF_LAYER, "speculators": INPUT_OF_LAYER, "sglang": OUTPUT_OF_LAYER}

LAYER_TENSORS = (
    "input_layernorm.weight", "hidden_norm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)
TOP_TENSORS = ("fc.weight", "norm.weight", "lm_head.weight")
OPTIONAL_TENSORS = ("embed_tokens.weight",)
VOCAB_TENSORS = ("d2t", "t2d")
VARIANT_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


def variant_tensors(config: DrafterConfig) -> list[str]:
    """The norms before `fc` this drafter variant has (same name in every layout)."""
    if config.norm_before_fc:
        return ["input_norm.weight"]
    if config.fc_norm:
        return [f"fc_norm.{i}.weight" for i in range(len(config.aux_layer_ids))]
    return []


# Tensors of drafter variants eaglekit does not implement: importing them would silently drop behaviour.
UNSUPPORTED_PREFIXES = ("layers.1.", "midlayer.self_attn.q_norm")
# P-EAGLE (drafter_type p-eagle): `mask_hidden` (1, n_aux*H_target) in every layout (speculators: (1, 1, n_aux*H_t);
# vLLM reads it through `.view(1, -1)`), the parallel-drafting token id in config.json: `ptd_token_id` here (vLLM
# also reads `mask_token_id` and `pard_token`), `mask_token_id` for speculators' peagle
PARALLEL_TOKEN_KEYS = ("ptd_token_id", "pard_token", "mask_token_id")
SPECULATORS_PEAGLE_ARCHITECTURE = "PEagleSpeculator"


def layer_prefix(fmt: str) -> str:
    return "layers.0." if fmt == "speculators" else "midlayer."


def key_map(fmt: str) -> dict[str, str]:
    """eaglekit tensor name -> checkpoint tensor name, for every tensor the format can hold."""
    prefix = layer_prefix(fmt)
    mapping = {f"midlayer.{name}": f"{prefix}{name}" for name in LAYER_TENSORS + mla_format.LAYER_TENSORS}
    mapping.update({name: name for name in TOP_TENSORS + OPTIONAL_TENSORS + VOCAB_TENSORS})
    mapping["input_norm.weight"] = "input_norm.weight"
    mapping["mask_hidden"] = "mask_hidden"
    mapping.update({f"fc_norm.{i}.weight": f"fc_norm.{i}.weight" for i in range(3)})
    return mapping


def required_keys(fmt: str, config: DrafterConfig) -> list[str]:
    """Checkpoint tensors the engine's loader needs for this drafter to run correctly.

    The loaders skip what they do not find (SGLang silently; vLLM leaves `draft_id_to_target_id`
    at zero when `d2t` is absent), so a missing key means a drafter that loads and proposes garbage.
    """
    prefix = layer_prefix(fmt)
    layer = mla_format.LAYER_TENSORS if mla_format.is_mla(config) else LAYER_TENSORS
    keys = [f"{prefix}{name}" for name in layer] + list(TOP_TENSORS) + variant_tensors(config)
    if config.drafter_type == "p-eagle":
        keys.append("mask_hidden")
    if config.draft_vocab_size < config.vocab_size:
        keys += ["d2t", "t2d"] if fmt == "speculators" else ["d2t"]
    return keys


# --- configs --------------------------------------------------------------------------------
def _rope_legacy(rope: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """transformers-5 `rope_parameters` -> (`rope_theta`, `rope_scaling`) as the engines' configs hold them."""
    theta = float(rope.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default" and set(scaling) <= {"rope_type"}:
        return theta, None
    return theta, scaling


def _rope_from(data: dict[str, Any]) -> dict[str, Any]:
    if isinstance(data.get("rope_parameters"), dict):
        rope = dict(data["rope_parameters"])
        rope.setdefault("rope_theta", float(data.get("rope_theta", 10000.0)))
        return rope
    scaling = dict(data.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    return {"rope_type": "default", **scaling, "rope_theta": float(data.get("rope_theta", 10000.0))}


def llama_fields(config: DrafterConfig) -> dict[str, Any]:
    """The LlamaConfig keys of the single-layer drafter, as every engine reads them."""
    theta, scaling = _rope_legacy(dict(config.rope_parameters))
    return {
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.resolved_head_dim,
        "num_hidden_layers": 1,
        "vocab_size": config.vocab_size,
        "rms_norm_eps": config.rms_norm_eps,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }


def engine_config(config: DrafterConfig, fmt: str, dtype: str, speculative_tokens: int = 3) -> dict[str, Any]:
    """config.json for `fmt`, with the aux layer ids converted to that engine's convention."""
    input_ids = list(to_input_convention(config.aux_layer_ids, config.aux_layer_convention))
    engine_ids = list(from_input_convention(tuple(input_ids), CONVENTION[fmt]))
    marker = {"format": fmt, "aux_layer_convention": CONVENTION[fmt], "aux_layer_ids_input_of_layer": input_ids,
              "target_num_layers": config.target_num_layers, "target_name_or_path": config.target_name_or_path,
              "target_architecture": config.target_architecture, "target_weights_hash": config.target_weights_hash}
    parallel = config.drafter_type == "p-eagle"
    if fmt == "speculators":
        verifier = {"name_or_path": verifier_path(config.target_name_or_path),
                    "architectures": [config.target_architecture] if config.target_architecture else []}
        kind = "peagle" if parallel else "eagle3"
        return {
            "architectures": [SPECULATORS_PEAGLE_ARCHITECTURE if parallel else SPECULATORS_ARCHITECTURE],
            "speculators_model_type": kind,
            **({"mask_token_id": config.mask_token_id} if parallel else {}),
            "transformer_layer_config": llama_fields(config),
            "draft_vocab_size": config.draft_vocab_size,
            "target_hidden_size": config.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": engine_ids,
            "norm_before_residual": config.norm_before_residual,  # vLLM defaults it to True when absent
            **{flag: getattr(config, flag) for flag in VARIANT_FLAGS},
            "speculators_config": {
                "algorithm": kind,
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
                "default_proposal_method": "greedy",
                "verifier": verifier,
            },
            "torch_dtype": dtype,
            MARKER: marker,
        }
    if mla_format.is_mla(config):
        base = mla_format.config_fields(config, *_rope_legacy(dict(config.rope_parameters)))
    else:
        base = {"architectures": [EAGLE3_ARCHITECTURES[0]], **llama_fields(config)}
    data = {**base,
            "draft_vocab_size": config.draft_vocab_size, "target_hidden_size": config.target_hidden_size,
            "norm_before_residual": config.norm_before_residual, "torch_dtype": dtype,
            **{flag: getattr(config, flag) for flag in VARIANT_FLAGS},
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": engine_ids, "use_aux_hidden_state": True}}
    if config.norm_before_fc:  # where vLLM and SGLang look first
        data["eagle_config"]["norm_before_fc"] = True
    if fmt == "vllm":  # vLLM >= 0.2x reads the explicit ids from the top level of the draft config only
        data["eagle_aux_hidden_state_layer_ids"] = engine_ids
    if parallel:  # served with speculative_config {"method": "eagle3", "parallel_drafting": true}
        data["ptd_token_id"] = config.mask_token_id
        data["parallel_drafting"] = True
    data[MARKER] = marker
    return data


def check_exportable(config: DrafterConfig, fmt: str) -> None:
    """Refuse drafters the target engine would load with different behaviour."""
    if fmt not in EXPORT_FORMATS:
        raise EaglekitError(f"unknown export format '{fmt}'; use one of {', '.join(EXPORT_FORMATS)}")
    if mla_format.is_mla(config):
        mla_format.check_exportable(config, fmt)
    input_ids = to_input_convention(config.aux_layer_ids, config.aux_layer_convention)
    if fmt == "sglang":
        if config.norm_before_residual:
            raise EaglekitError("SGLang's llama_eagle3 has no norm_before_residual: it would run this drafter with the "
                                "residual taken before hidden_norm. Export it --to vllm or --to speculators instead")
        if min(input_ids) < 1:
            raise EaglekitError(f"aux layer ids {input_ids} include 0 (the embedding output), which SGLang cannot "
                                "address (its explicit ids mean 'output of layer k'); retrain with "
                                "ids >= 1 or use vLLM")
    if config.drafter_type == "p-eagle" and fmt == "sglang":
        raise EaglekitError("SGLang has no parallel drafting (P-EAGLE): export this drafter --to vllm or --to "
                            "speculators, or fine-tune an eagle3 drafter for SGLang")
    if fmt == "speculators" and config.target_hidden_size != config.hidden_size:
        raise EaglekitError("speculators sizes fc from the drafter's hidden size "
                            f"({config.hidden_size}), but this drafter fuses target states of width "
                            f"{config.target_hidden_size}; export it --to vllm or --to sglang")


def check_required(fmt: str, config: DrafterConfig, state: dict[str, torch.Tensor]) -> None:
    """Every tensor the loader needs is present with the shape the loader will build."""
    missing = [k for k in required_keys(fmt, config) if k not in state]
    if missing:
        raise EaglekitError(f"{fmt} checkpoint would lack {missing}: the engine would load it and skip them silently. "
                            "Is the drafter complete (`eaglekit vocab` installs d2t/t2d)?")
    h, d = config.hidden_size, config.resolved_head_dim
    prefix = layer_prefix(fmt)
    shapes = {
        "fc.weight": (h, 3 * config.target_hidden_size),
        "lm_head.weight": (config.draft_vocab_size, h),
        f"{prefix}self_attn.q_proj.weight": (config.num_attention_heads * d, 2 * h),
        f"{prefix}self_attn.k_proj.weight": (config.num_key_value_heads * d, 2 * h),
        "d2t": (config.draft_vocab_size,),
        "t2d": (config.vocab_size,),
        "input_norm.weight": (3 * config.target_hidden_size,),
        "mask_hidden": ((1, 1, 3 * config.target_hidden_size) if fmt == "speculators"
                        else (1, 3 * config.target_hidden_size)),
        **{f"fc_norm.{i}.weight": (config.target_hidden_size,) for i in range(3)},
    }
    if mla_format.is_mla(config):
        shapes.update(mla_format.tensor_shapes(config, prefix))
    for key, shape in shapes.items():
        if key in state and tuple(state[key].shape) != shape:
            raise EaglekitError(f"{fmt} checkpoint tensor {key} has shape {tuple(state[key].shape)}, the "
                                f"loader expects {shape}")


def to_checkpoint_state(state: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    """eaglekit state dict -> `fmt` tensor names (explicit map; unknown names are an error)."""
    mapping = key_map(fmt)
    unknown = sorted(set(state) - set(mapping))
    if unknown:
        raise EaglekitError(f"drafter has tensors {unknown} that the {fmt} layout cannot hold")
    if fmt == "speculators" and "mask_hidden" in state:  # speculators' PEagleDraftModel holds (1, 1, n)
        state = {**state, "mask_hidden": state["mask_hidden"].reshape(1, 1, -1)}
    return {mapping[k]: v for k, v in state.items()}


# SGLang's older names of the fc_norm chunks (its loader still maps them)
LEGACY_NAMES = {"aux_norm_low.weight": "fc_norm.0.weight", "aux_norm_mid.weight": "fc_norm.1.weight",
                "aux_norm_high.weight": "fc_norm.2.weight"}


def from_checkpoint_state(state: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    """`fmt` tensor names -> eaglekit names; tensors of unsupported drafter variants are refused."""
    state = {LEGACY_NAMES.get(k, k): v for k, v in state.items()}
    inverse = {v: k for k, v in key_map(fmt).items()}
    bad = sorted(k for k in state if k.startswith(UNSUPPORTED_PREFIXES))
    if bad:
        raise EaglekitError(f"checkpoint holds {bad}: a drafter variant (extra layers, q/k norms, "
                            "parallel drafting) that eaglekit does not implement; importing it "
                            "would drop those weights")
    unknown = sorted(k for k in state if k not in inverse)
    if unknown:
        raise EaglekitError(f"checkpoint has tensors eaglekit does not know: {unknown}")
    return {inverse[k]: v for k, v in state.items()}


# --- reading ------------------------------------------------------------------------------


def parallel_fields(data: dict[str, Any], state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """DrafterConfig fields of a P-EAGLE checkpoint (a `mask_hidden` tensor): drafter_type and the token id; {} for
    an EAGLE-3 one. A `mask_hidden` without a token id in config.json is refused (vLLM would refuse it too)."""
    if "mask_hidden" not in state:
        return {}
    token = next((data[key] for key in PARALLEL_TOKEN_KEYS if data.get(key) is not None), None)
    if token is None:
        raise EaglekitError(f"the checkpoint has mask_hidden (P-EAGLE) but its config.json names no parallel-drafting "
                            f"token ({', '.join(PARALLEL_TOKEN_KEYS)}): add the token id it was trained with")
    return {"drafter_type": "p-eagle", "mask_token_id": int(token)}


def is_eagle3_checkpoint(data: dict[str, Any]) -> bool:
    """True for the config.json of an EAGLE-3 (or P-EAGLE) drafter in an engine's layout (not eaglekit's own)."""
    try:
        return detect_format(data) != "eaglekit"
    except EaglekitError:
        return False


def detect_format(data: dict[str, Any]) -> str:
    """'eaglekit', 'speculators' or 'eagle3' (the EAGLE/vLLM/SGLang layout) from a config dict."""
    if data.get("format") == "eaglekit-eagle3":
        return "eaglekit"
    if data.get("speculators_model_type") is not None:
        if data["speculators_model_type"] not in ("eagle3", "peagle"):
            raise EaglekitError("speculators checkpoint of type "
                                f"'{data['speculators_model_type']}'; eagle3 and peagle import here")
        return "speculators"
    architectures = data.get("architectures") or []
    if (any(a in EAGLE3_ARCHITECTURES for a in architectures) or "eagle_config" in data
            or mla_format.is_mla_checkpoint(data)):
        return "eagle3"
    raise EaglekitError(f"config.json with architectures {architectures} is not an EAGLE-3 drafter in a known layout "
                        f"(expected one of {', '.join(EAGLE3_ARCHITECTURES)} or a speculators eagle3 config)")


