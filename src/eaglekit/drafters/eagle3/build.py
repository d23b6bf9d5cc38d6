"""Building the drafter for a target: shapes and RoPE from the target's config, the target's embedding
(frozen) and lm_head read from its checkpoint, `init_from` an existing drafter, and the vocabulary
mapping (kept from `init_from`, or remapped when the user asks to rebuild it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any, Callable

import torch

from eaglekit.drafters.eagle3 import mla
from eaglekit.drafters.eagle3.model import FORMAT, INPUT_OF_LAYER, DrafterConfig, Eagle3Drafter
from eaglekit.drafters.vocab import VocabMapping, load_vocab, mapping_from_drafter, remap_rows, select_vocab
from eaglekit.errors import EaglekitError

log = logging.getLogger(__name__)


def rope_parameters(text_config: Any) -> dict[str, Any]:
    """RoPE settings of a target config, as a transformers-5 `rope_parameters` dict."""
    params = getattr(text_config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        if "rope_theta" not in params and "full_attention" in params:  # per-layer-type settings (Gemma 3 style)
            params = params["full_attention"]
        return dict(params)
    scaling = dict(getattr(text_config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    return {**scaling, "rope_theta": float(getattr(text_config, "rope_theta", 10000.0))}


def drafter_config_for(text_config: Any, draft_vocab_size: int, aux_layers: tuple[int, ...], target_name: str,
                       architecture: str) -> DrafterConfig:
    """A drafter shaped like one layer of the target (hidden, heads, MLP width, RoPE, vocabulary)."""
    hidden = int(text_config.hidden_size)
    heads = int(text_config.num_attention_heads)
    return DrafterConfig(
        hidden_size=hidden,
        intermediate_size=int(text_config.intermediate_size),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(text_config, "num_key_value_heads", None) or heads),
        vocab_size=int(text_config.vocab_size),
        draft_vocab_size=min(draft_vocab_size, int(text_config.vocab_size)),
        target_hidden_size=hidden,
        aux_layer_ids=tuple(aux_layers),
        head_dim=getattr(text_config, "head_dim", None) or hidden // heads,
        rms_norm_eps=float(getattr(text_config, "rms_norm_eps", 1e-6)),
        rope_parameters=rope_parameters(text_config),
        max_position_embeddings=int(getattr(text_config, "max_position_embeddings", 4096)),
        target_name_or_path=target_name,
        target_architecture=architecture,
        target_num_layers=int(text_config.num_hidden_layers),
    )


VARIANT_OPTIONS = ("norm_before_fc", "fc_norm", "norm_output")  # train options that are DrafterConfig fields


def requested_variant(options: Any) -> dict[str, bool]:
    """The drafter-variant options a training run sets (`eaglekit train fc_norm=true ...`)."""
    return {flag: True for flag in VARIANT_OPTIONS if getattr(options, flag, False)}


def _checkpoint_tensors(directory: Path, names: list[str]) -> dict[str, torch.Tensor] | None:
    """Read `names` (or keys ending with them) from a local safetensors checkpoint; None if not possible."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (directory / "model.safetensors").is_file():
        with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
            weight_map = {key: "model.safetensors" for key in handle.keys()}
    else:
        return None
    found = {}
    for name in names:
        keys = [k for k in weight_map if k == name] or [k for k in weight_map if k.endswith(name.split(".", 1)[-1])]
        if len(keys) != 1:
            return None
        with safe_open(str(directory / weight_map[keys[0]]), framework="pt") as handle:
            found[name] = handle.get_tensor(keys[0])
    return found


def load_target_embeddings(name_or_path: str, trust_remote_code: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embedding (V, H), lm_head (V, H)) of a target, read from its checkpoint without loading the
    model where possible (offline training needs only these two)."""
    from transformers import AutoModelForCausalLM

    from eaglekit.target.loading import load_target, load_target_config, locate_target

    path = locate_target(name_or_path)  # a hub id: one request, else its cached snapshot, else one error line
    config = load_target_config(name_or_path, trust_remote_code)
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        names = {id(p): n for n, p in skeleton.named_parameters(remove_duplicate=False)}
        embed_name = names[id(skeleton.get_input_embeddings().weight)]
        head = skeleton.get_output_embeddings().weight
        tied = head is skeleton.get_input_embeddings().weight
        wanted = [embed_name] if tied else [embed_name, names[id(head)]]
        tensors = _checkpoint_tensors(Path(path), wanted) if Path(path).is_dir() else None
    except (ValueError, KeyError, AttributeError):
        tensors = None
    if tensors is not None:
        embed = tensors[embed_name]
        return embed, embed if tied else tensors[wanted[1]]
    log.info("reading embedding and lm_head by loading the whole target %s on the CPU", name_or_path)
    model = load_target(name_or_path, "cpu", torch.float32, trust_remote_code=trust_remote_code)
    return model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach()


def load_target_head_bias(name_or_path: str, trust_remote_code: bool = False) -> torch.Tensor | None:
    """The bias (V,) of a target's lm_head (Phi has one), read from its checkpoint; None when it has none."""
    from transformers import AutoModelForCausalLM

    from eaglekit.target.loading import load_target, load_target_config, locate_target

    path = locate_target(name_or_path)  # a hub id: one request, else its cached snapshot, else one error line
    config = load_target_config(name_or_path, trust_remote_code)
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        bias = getattr(skeleton.get_output_embeddings(), "bias", None)
        if bias is None:
            return None
        name = {id(p): n for n, p in skeleton.named_parameters()}[id(bias)]
        tensors = _checkpoint_tensors(Path(path), [name]) if Path(path).is_dir() else None
    except (ValueError, KeyError, AttributeError):
        tensors, name = None, ""
    if tensors is not None:
        return tensors[name]
    log.info("reading the lm_head's bias by loading the whole target %s on the CPU", name_or_path)
    model = load_target(name_or_path, "cpu", torch.float32, trust_remote_code=trust_remote_code)
    bias = getattr(model.get_output_embeddings(), "bias", None)
    return None if bias is None else bias.detach()


DrafterReader = Callable[[str, int], Eagle3Drafter]  # (directory, target's layer count) -> drafter


# --- drafter types: what a saved drafter is, and the class that loads it ---------------------------------------
def saved_drafter_type(directory: str | Path) -> str:
    """The `drafter_type` an eaglekit drafter directory was saved as ("eagle3", "p-eagle", "dflash"): its
    config.json's `drafter_type`, or "eagle3" for an eaglekit-eagle3 drafter written before that key existed."""
    config_path = Path(directory) / "config.json"
    if not Path(directory).exists():
        from eaglekit.target.loading import missing_path_error

        raise missing_path_error(str(directory), "drafter", "give a drafter directory (`eaglekit train` or "
                                 "`eaglekit import` output)")
    if not config_path.is_file():
        raise EaglekitError(f"{directory}: no config.json there; give a drafter directory (`eaglekit train` or "
                            "`eaglekit import` output)")
    try:
        data = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise EaglekitError(f"{config_path} is not valid JSON ({error}); re-run the stage that wrote it") from None
    if "drafter_type" in data:
        return str(data["drafter_type"])
    if data.get("format") == FORMAT:
        return "eagle3"
    raise EaglekitError(f"{directory} is not an eaglekit drafter; convert it with `eaglekit import --source "
                        f"{directory}` first")


def drafter_classes() -> dict[str, Any]:
    """drafter_type -> the class that builds (`cls(config)`), saves (`save_pretrained`) and loads
    (`cls.from_pretrained(directory, device=, dtype=)`) drafters of that type."""
    from eaglekit.drafters.dflash.model import DFlashDrafter

    return {"eagle3": Eagle3Drafter, "p-eagle": Eagle3Drafter, "dflash": DFlashDrafter}


def drafter_class(drafter_type: str) -> Any:
    classes = drafter_classes()
    if drafter_type not in classes:
        raise EaglekitError(f"drafter type {drafter_type!r} is not one this eaglekit loads ({', '.join(classes)}); "
                            "upgrade eaglekit, or re-train the drafter")
    return classes[drafter_type]


def drafter_type_of(drafter: Any) -> str:
    """The drafter type of a loaded drafter ("eagle3" for a config without the field)."""
    return str(getattr(drafter.config, "drafter_type", "eagle3"))


def load_saved_drafter(directory: str | Path, device: str | torch.device = "cpu",
                       dtype: torch.dtype | None = None) -> Any:
    """Any eaglekit drafter directory, loaded by the class of its saved drafter type."""
    return drafter_class(saved_drafter_type(directory)).from_pretrained(directory, device=device, dtype=dtype)


def load_drafter(path: str, target_num_layers: int) -> Eagle3Drafter:
    """An eaglekit drafter (`init_from`); other layouts need a reader that knows them, such as
    `eaglekit.drafters.eagle3.convert.load_drafter`, which `eaglekit train` passes to `prepare_drafter`."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise EaglekitError(f"init_from={path}: no config.json there; give a drafter directory")
    data = json.loads(config_path.read_text())
    if data.get("format") != FORMAT and "drafter_type" not in data:
        raise EaglekitError(f"init_from={path} is not in eaglekit format; convert it with `eaglekit import` first, or "
                            "train through `eaglekit train`, which reads the EAGLE/SGLang/vLLM/speculators layouts")
    return load_saved_drafter(path)


def with_vocab(drafter: Eagle3Drafter, mapping: VocabMapping, seed: int) -> tuple[Eagle3Drafter, int]:
    """A copy of `drafter` over a new draft vocabulary: lm_head rows of kept ids move, new ids get a fresh init."""
    old = mapping_from_drafter(drafter)
    config = DrafterConfig.from_dict({**drafter.config.to_dict(), "draft_vocab_size": int(mapping.used_ids.numel())})
    new = Eagle3Drafter(config)
    state = {k: v for k, v in drafter.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    new.load_state_dict(state, strict=False)
    fresh = torch.empty_like(new.lm_head.weight)
    bound = 1.0 / math.sqrt(fresh.shape[1])
    fresh.uniform_(-bound, bound, generator=torch.Generator().manual_seed(seed))
    rows, kept = remap_rows(drafter.lm_head.weight.detach(), old.used_ids, mapping.used_ids, fresh)
    with torch.no_grad():
        new.lm_head.weight.copy_(rows)
    new.set_vocab_mapping(mapping.used_ids)
    new.embed_tokens.weight.requires_grad_(False)
    return new, kept


def check_against_target(config: DrafterConfig, text_config: Any, source: str) -> None:
    if config.target_hidden_size != int(text_config.hidden_size):
        raise EaglekitError(f"{source} was made for a target with hidden size "
                            f"{config.target_hidden_size}, this target has {text_config.hidden_size}: use a drafter "
                            "trained for this target, or start without init_from")
    if config.vocab_size != int(text_config.vocab_size):
        raise EaglekitError(f"{source} was made for a vocabulary of {config.vocab_size}, this target has "
                            f"{text_config.vocab_size}: wrong target or drafter")


def normal_init(drafter: Eagle3Drafter, std: float) -> None:
    """Every linear layer's weight drawn from N(0, std) (Hugging Face's `_init_weights`, which speculators and
    SpecForge drafters get, at std = 0.02), instead of torch's default (uniform, std 1/sqrt(3 fan_in))."""
    with torch.no_grad():
        for module in drafter.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, std)


def prepare_drafter(
    options: Any,  # eaglekit.config.train.TrainConfig
    text_config: Any,
    aux_layers: tuple[int, ...],  # input-of-layer ids
    architecture: str,
    count_tokens_fn: Callable[[], torch.Tensor],
    read_drafter: DrafterReader = load_drafter,  # loads `init_from`
) -> tuple[Eagle3Drafter, str]:
    """The drafter to train (of `options.drafter_type`) and a note on where its vocabulary came from."""
    if options.drafter_type not in ("eagle3", "p-eagle"):
        raise EaglekitError(f"drafter_type={options.drafter_type} is not trained by this eaglekit: use eagle3 or "
                            "p-eagle")
    drafter, note = _prepare_eagle3(options, text_config, aux_layers, architecture, count_tokens_fn, read_drafter)
    kind = drafter.config.drafter_type
    if options.drafter_type == "p-eagle":
        from eaglekit.drafters.p_eagle.train import to_parallel

        return to_parallel(drafter, options.mask_token_id, options.seed), note
    if kind != options.drafter_type:
        raise EaglekitError(f"init_from={options.init_from} is a {kind} drafter: pass drafter_type={kind} to "
                            f"fine-tune it (drafter_type={options.drafter_type} would drop what makes it {kind})")
    return drafter, note


def _prepare_eagle3(options: Any, text_config: Any, aux_layers: tuple[int, ...], architecture: str,
                    count_tokens_fn: Callable[[], torch.Tensor],
                    read_drafter: DrafterReader) -> tuple[Eagle3Drafter, str]:
    vocab = load_vocab(options.vocab) if options.vocab else None
    if vocab is not None and vocab.vocab_size != int(text_config.vocab_size):
        raise EaglekitError(f"{options.vocab} covers a vocabulary of {vocab.vocab_size}, the target has "
                            f"{text_config.vocab_size}")
    if not options.init_from:
        torch.manual_seed(options.seed)
        mapping = vocab or select_vocab(count_tokens_fn(), options.draft_vocab_size)
        config = drafter_config_for(text_config, int(mapping.used_ids.numel()), aux_layers, options.target,
                                    architecture)
        arch = mla.architecture_fields(options, text_config)  # drafter_arch=mla: the MLA dims
        drafter = Eagle3Drafter(dataclasses.replace(config, **requested_variant(options), **arch))
        if options.init_std > 0:
            normal_init(drafter, options.init_std)
        drafter.set_vocab_mapping(mapping.used_ids)
        note = f"from {options.vocab}" if vocab else "built from the training data"
        return drafter, f"{note} (coverage {select_coverage(mapping, count_tokens_fn):.2%})"
    drafter = read_drafter(options.init_from, int(text_config.num_hidden_layers))
    if drafter_type_of(drafter) == "dflash":  # another model altogether: nothing of it carries over to EAGLE-3
        raise EaglekitError(f"init_from={options.init_from} is a dflash drafter: pass drafter_type=dflash to "
                            f"fine-tune it, or drop init_from to train a fresh {options.drafter_type} drafter")
    check_against_target(drafter.config, text_config, options.init_from)
    mla.check_init_from(options, drafter.config, options.init_from)
    lacking = [flag for flag in requested_variant(options) if not getattr(drafter.config, flag)]
    if lacking:
        raise EaglekitError(f"{', '.join(f'{flag}=true' for flag in lacking)}: "
                            f"init_from={options.init_from} is a drafter without it, and fine-tuning keeps the "
                            "drafter's variant; drop the option, or train a fresh drafter")
    from eaglekit.target.capture import to_input_convention

    own = to_input_convention(drafter.config.aux_layer_ids, drafter.config.aux_layer_convention)
    if options.aux_layer_ids and tuple(options.aux_layer_ids) != tuple(own):
        raise EaglekitError(f"aux_layer_ids={list(options.aux_layer_ids)} differ from "
                            f"{options.init_from}'s layers {list(own)} ({INPUT_OF_LAYER} ids); drop aux_layer_ids= "
                            "to keep the drafter's")
    current = mapping_from_drafter(drafter)
    if vocab is None and options.rebuild_vocab:
        vocab = select_vocab(count_tokens_fn(), options.draft_vocab_size)
    if vocab is None or torch.equal(vocab.used_ids, current.used_ids):
        return drafter, f"kept from {options.init_from}"
    if not options.rebuild_vocab:
        raise EaglekitError(f"vocab={options.vocab} differs from the mapping of init_from={options.init_from}; "
                            "fine-tuning keeps the drafter's mapping: drop vocab=, or pass rebuild_vocab=true to remap "
                            "its lm_head rows to the new one")
    drafter, kept = with_vocab(drafter, vocab, options.seed)
    log.warning("draft vocabulary rebuilt: %d of %d lm_head rows carried over, the rest initialised fresh", kept,
                vocab.used_ids.numel())
    return drafter, f"rebuilt ({kept} rows carried over from {options.init_from})"


def select_coverage(mapping: VocabMapping, count_tokens_fn: Callable[[], torch.Tensor]) -> float:
    counts = mapping.counts if mapping.counts is not None else count_tokens_fn()
    return mapping.coverage(counts)
