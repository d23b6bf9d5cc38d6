"""Setting up a DFlash drafter for training (`eaglekit train drafter_type=dflash`): its shape from the target's
config, its target layers (given, the extract store's, or the published spread), its mask token, or `init_from` an
existing DFlash drafter (eaglekit's own, or vLLM's / speculators' layout, such as a published z-lab checkpoint).

Target layers and the store: a DFlash drafter names OUTPUT-of-layer ids (`target_layer_ids`, vLLM's convention);
extract stores hold INPUT-of-layer ids, so the store a drafter trains on must hold `target_layer_ids + 1`
(`eaglekit extract ... aux_layer_ids=...` takes any number of distinct ids).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch

from eaglekit.drafters.common import normal_init, target_shape
from eaglekit.drafters.dflash.model import (
    DEFAULT_BLOCK_SIZE,
    DFlashConfig,
    DFlashDrafter,
    default_target_layer_ids,
)
from eaglekit.errors import EaglekitError
from eaglekit.training.vocab import load_vocab, mapping_from_drafter, select_coverage, select_vocab

log = logging.getLogger(__name__)


def target_layers(options: Any, num_layers: int, store_ids: tuple[int, ...] | None) -> tuple[int, ...]:
    """The drafter's output-of-layer ids: `target_layer_ids`, else the store's (input-of-layer ids - 1), else
    `default_target_layer_ids`; refused (with the extract command that fixes it) when the store holds others."""
    wanted = tuple(options.target_layer_ids)
    if store_ids is not None:
        own = tuple(i - 1 for i in store_ids)
        if 0 in store_ids and not wanted:
            raise EaglekitError(f"the extract store holds the embedding output (input-of-layer id 0 in "
                                f"{list(store_ids)}), which a DFlash drafter cannot read: pass target_layer_ids=, and "
                                "extract them with aux_layer_ids= those ids + 1")
        if wanted and wanted != own:
            fix = ",".join(str(i + 1) for i in wanted)
            raise EaglekitError(f"target_layer_ids={list(wanted)} (output-of-layer) need the states entering layers "
                                f"{fix}, but {options.shards} holds input-of-layer ids {list(store_ids)}: re-run "
                                f"`eaglekit extract ... aux_layer_ids={fix}` into a new output, or drop "
                                "target_layer_ids to train on the store's layers")
        wanted = wanted or own
    wanted = wanted or default_target_layer_ids(num_layers, options.draft_layers)
    if len(set(wanted)) != len(wanted) or not all(0 <= i < num_layers for i in wanted):
        raise EaglekitError(f"target_layer_ids={list(wanted)} must be distinct output-of-layer ids of the target's "
                            f"{num_layers} layers (0..{num_layers - 1})")
    return wanted


def mask_token(options: Any) -> int:
    """`mask_token_id`, else the tokenizer's mask token, else its pad token, else its end-of-sequence token."""
    if options.mask_token_id >= 0:
        return int(options.mask_token_id)
    from eaglekit.targets.loading import load_tokenizer

    tokenizer = load_tokenizer(options.target, trust_remote_code=options.trust_remote_code)
    for name in ("mask_token_id", "pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            log.info("DFlash mask token: the tokenizer's %s %d (pass mask_token_id= to choose)", name[:-3], value)
            return value
    raise EaglekitError(f"{options.target}'s tokenizer has no mask, pad or end-of-sequence token: pass mask_token_id=")


def fresh_config(options: Any, text_config: Any, architecture: str, draft_vocab_size: int,
                 layer_ids: tuple[int, ...]) -> DFlashConfig:
    """A DFlash drafter shaped like the target's layers (hidden, heads, MLP width, RoPE), `draft_layers` deep."""
    shape = target_shape(text_config, options.target, architecture)
    return DFlashConfig(**shape, draft_vocab_size=min(draft_vocab_size, shape["vocab_size"]),
                        num_hidden_layers=options.draft_layers, target_layer_ids=layer_ids,
                        mask_token_id=mask_token(options), block_size=options.block_size)


def check_init(options: Any, drafter: DFlashDrafter, text_config: Any, layer_ids: tuple[int, ...]) -> None:
    config = drafter.config
    if config.target_hidden_size != int(text_config.hidden_size) or config.vocab_size != int(text_config.vocab_size):
        raise EaglekitError(f"init_from={options.init_from} was made for another target (hidden size "
                            f"{config.target_hidden_size}, vocabulary {config.vocab_size}; this target: "
                            f"{text_config.hidden_size}, {text_config.vocab_size})")
    if tuple(config.target_layer_ids) != layer_ids:
        raise EaglekitError(f"init_from={options.init_from} reads target layers {list(config.target_layer_ids)} "
                            f"(output-of-layer), this run {list(layer_ids)}: drop target_layer_ids, or extract the "
                            f"drafter's layers (aux_layer_ids={','.join(str(i + 1) for i in config.target_layer_ids)})")
    if options.block_size != config.block_size:
        log.warning("init_from=%s was trained on blocks of %d; training it on blocks of %d", options.init_from,
                    config.block_size, options.block_size)


def read_init(options: Any, read_drafter: Callable[[str, int], Any], num_layers: int,
              lm_head: Callable[[], torch.Tensor]) -> DFlashDrafter:
    """`init_from` read by `read_drafter` (eaglekit's own format; `eaglekit train` also reads vLLM's and speculators'
    DFlash layouts); a checkpoint without its own lm_head (it drafts with the target's) gets the target's."""
    drafter = read_drafter(options.init_from, num_layers)
    if not isinstance(drafter, DFlashDrafter):
        kind = getattr(drafter.config, "drafter_type", "eagle3")
        raise EaglekitError(f"init_from={options.init_from} is a {kind} drafter; drafter_type=dflash starts from a "
                            "DFlash drafter (or none): drop init_from, or pass drafter_type=" + kind)
    if not bool(drafter.lm_head.weight.any()):
        drafter.load_target_lm_head(lm_head())
    return drafter


def prepare_dflash(options: Any, target: Any,
                   default_block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[DFlashDrafter, str]:
    """The DFlash drafter to train (or `init_from`'s drafter of a type built on DFlash) and a note on where its
    vocabulary came from. `target` (`eaglekit.training.setup.TrainingTarget`): `store_aux_ids`, the extract store's
    input-of-layer ids (offline), `lm_head()`, the target's lm_head (V, H), for a checkpoint without its own,
    `read_drafter(path, target layers)` reads `init_from`. `block_size=0` is `init_from`'s, else
    `default_block_size`."""
    text_config, count_tokens_fn, store_ids = target.text_config, target.count_tokens, target.store_aux_ids
    num_layers = int(text_config.num_hidden_layers)
    if options.init_from:
        drafter = read_init(options, target.read_drafter, num_layers, target.lm_head)
        options = dataclasses.replace(options, block_size=options.block_size or drafter.config.block_size)
        layer_ids = target_layers(dataclasses.replace(options, target_layer_ids=options.target_layer_ids
                                                      or drafter.config.target_layer_ids), num_layers, store_ids)
        check_init(options, drafter, text_config, layer_ids)
        if options.block_size != drafter.config.block_size:
            config = dataclasses.replace(drafter.config, block_size=options.block_size)
            drafter = _with_config(drafter, config)
        if options.vocab and not torch.equal(load_vocab(options.vocab).used_ids,
                                             mapping_from_drafter(drafter).used_ids):
            raise EaglekitError(f"vocab={options.vocab} differs from the mapping of init_from={options.init_from}; "
                                "fine-tuning keeps the drafter's mapping: drop vocab=")
        return drafter, f"kept from {options.init_from}"
    options = dataclasses.replace(options, block_size=options.block_size or default_block_size)
    layer_ids = target_layers(options, num_layers, store_ids)
    torch.manual_seed(options.seed)
    vocab = load_vocab(options.vocab) if options.vocab else None
    mapping = vocab or select_vocab(count_tokens_fn(), options.draft_vocab_size)
    config = fresh_config(options, text_config, target.architecture, int(mapping.used_ids.numel()), layer_ids)
    drafter = DFlashDrafter(config)
    if options.init_std > 0:
        normal_init(drafter, options.init_std)
    drafter.set_vocab_mapping(mapping.used_ids)
    note = f"from {options.vocab}" if vocab else "built from the training data"
    return drafter, f"{note} (coverage {select_coverage(mapping, count_tokens_fn):.2%})"


def _with_config(drafter: DFlashDrafter, config: DFlashConfig) -> DFlashDrafter:
    new = type(drafter)(config)
    new.load_state_dict(drafter.state_dict())
    new.embed_tokens.weight.requires_grad_(False)
    return new
