"""Building the EAGLE-3 drafter a training run starts from: shapes and RoPE from the target's config, the variant
and midlayer options, or `init_from` an existing drafter, and the vocabulary mapping (kept from `init_from`, or
remapped when the user asks to rebuild it).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch

from eaglekit.drafters.common import normal_init, target_shape
from eaglekit.drafters.eagle3 import mla
from eaglekit.drafters.eagle3.config import DrafterConfig
from eaglekit.drafters.eagle3.model import Eagle3Drafter
from eaglekit.errors import EaglekitError
from eaglekit.layers import INPUT_OF_LAYER
from eaglekit.training.vocab import (
    VocabMapping,
    load_vocab,
    mapping_from_drafter,
    remap_rows,
    select_coverage,
    select_vocab,
)

log = logging.getLogger(__name__)


def drafter_config_for(text_config: Any, draft_vocab_size: int, aux_layers: tuple[int, ...], target_name: str,
                       architecture: str) -> DrafterConfig:
    """A drafter shaped like one layer of the target (hidden, heads, MLP width, RoPE, vocabulary)."""
    shape = target_shape(text_config, target_name, architecture)
    return DrafterConfig(**shape, draft_vocab_size=min(draft_vocab_size, shape["vocab_size"]),
                         aux_layer_ids=tuple(aux_layers))


VARIANT_OPTIONS = ("norm_before_fc", "fc_norm", "norm_output")  # train options that are DrafterConfig fields


def requested_variant(options: Any) -> dict[str, bool]:
    """The drafter-variant options a training run sets (`eaglekit train fc_norm=true ...`)."""
    return {flag: True for flag in VARIANT_OPTIONS if getattr(options, flag, False)}


# --- drafter types: what a saved drafter is, and the class that loads it ---------------------------------------


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


def prepare_drafter(options: Any, target: Any) -> tuple[Eagle3Drafter, str]:
    """The EAGLE-3 drafter to train (`drafter_type=eagle3`) and a note on where its vocabulary came from.
    `options`: `eaglekit.config.train.TrainConfig`; `target`: `eaglekit.training.setup.TrainingTarget`."""
    drafter, note = prepare_eagle3(options, target)
    kind = drafter.config.drafter_type
    if kind != options.drafter_type:
        raise EaglekitError(f"init_from={options.init_from} is a {kind} drafter: pass drafter_type={kind} to "
                            f"fine-tune it (drafter_type={options.drafter_type} would drop what makes it {kind})")
    return drafter, note


def prepare_eagle3(options: Any, target: Any) -> tuple[Eagle3Drafter, str]:
    """The EAGLE-3 drafter a run of any type built on it starts from (P-EAGLE converts it): fresh, shaped like the
    target and its `aux_layers`, or `init_from`'s, checked against the options; and the note on its vocabulary."""
    text_config, count_tokens_fn = target.text_config, target.count_tokens
    vocab = load_vocab(options.vocab) if options.vocab else None
    if vocab is not None and vocab.vocab_size != int(text_config.vocab_size):
        raise EaglekitError(f"{options.vocab} covers a vocabulary of {vocab.vocab_size}, the target has "
                            f"{text_config.vocab_size}")
    if not options.init_from:
        torch.manual_seed(options.seed)
        mapping = vocab or select_vocab(count_tokens_fn(), options.draft_vocab_size)
        config = drafter_config_for(text_config, int(mapping.used_ids.numel()), target.aux_layers, options.target,
                                    target.architecture)
        arch = mla.architecture_fields(options, text_config)  # drafter_arch=mla: the MLA dims
        drafter = Eagle3Drafter(dataclasses.replace(config, **requested_variant(options), **arch))
        if options.init_std > 0:
            normal_init(drafter, options.init_std)
        drafter.set_vocab_mapping(mapping.used_ids)
        note = f"from {options.vocab}" if vocab else "built from the training data"
        return drafter, f"{note} (coverage {select_coverage(mapping, count_tokens_fn):.2%})"
    drafter = target.read_drafter(options.init_from, int(text_config.num_hidden_layers))
    if not isinstance(drafter, Eagle3Drafter):  # another model altogether: nothing of it carries over to EAGLE-3
        kind = drafter.config.drafter_type
        raise EaglekitError(f"init_from={options.init_from} is a {kind} drafter: pass drafter_type={kind} to "
                            f"fine-tune it, or drop init_from to train a fresh {options.drafter_type} drafter")
    check_against_target(drafter.config, text_config, options.init_from)
    mla.check_init_from(options, drafter.config, options.init_from)
    lacking = [flag for flag in requested_variant(options) if not getattr(drafter.config, flag)]
    if lacking:
        raise EaglekitError(f"{', '.join(f'{flag}=true' for flag in lacking)}: "
                            f"init_from={options.init_from} is a drafter without it, and fine-tuning keeps the "
                            "drafter's variant; drop the option, or train a fresh drafter")
    from eaglekit.targets.capture import to_input_convention

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


def planned_config(train: Any, target_config: Any, aux_layers: tuple[int, ...]) -> DrafterConfig | None:
    """The `DrafterConfig` that `eaglekit train` (config: `TrainConfig`) will build for this target, without
    data: the draft vocabulary's size is its upper bound. None where it cannot be told beforehand (an `init_from`
    in another format)."""
    import json
    from pathlib import Path

    from eaglekit.drafters.eagle3.config import FORMAT
    from eaglekit.targets.capture import text_config

    if train.init_from:
        path = Path(train.init_from) / "config.json"
        data = json.loads(path.read_text()) if path.is_file() else {}
        return DrafterConfig.from_dict(data) if data.get("format") == FORMAT else None
    tc = text_config(target_config)
    architecture = (getattr(target_config, "architectures", None) or [type(target_config).__name__])[0]
    config = drafter_config_for(tc, train.draft_vocab_size, aux_layers, train.target, architecture)
    return dataclasses.replace(config, **requested_variant(train), **mla.architecture_fields(train, tc))
