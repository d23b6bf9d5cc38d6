"""Setting up a DSpark drafter for training (`eaglekit train drafter_type=dspark`): DFlash's setup builds the backbone
(shape, target layers, mask token, vocabulary; or `init_from` a DFlash or DSpark drafter, `eaglekit.drafters.dflash.
setup`), then the DSpark heads and layout come from the options: fresh on a fresh or DFlash backbone, kept from a
DSpark `init_from` (where an option asking for other heads is refused: fine-tuning keeps the drafter's variant)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from eaglekit.drafters.dflash.setup import prepare_dflash
from eaglekit.drafters.dspark.model import DEFAULT_BLOCK_SIZE, DSparkConfig, DSparkDrafter
from eaglekit.errors import EaglekitError

HEAD_OPTIONS = ("markov_rank", "markov_head_type", "confidence_head", "confidence_head_with_markov",
                "sample_from_anchor")  # train options that are DSparkConfig fields


def head_fields(options: Any) -> dict[str, Any]:
    """The DSparkConfig fields the train options ask for."""
    fields = {name: getattr(options, name) for name in HEAD_OPTIONS}
    if fields["markov_rank"] == 0:  # no Markov head: the confidence head reads the hidden state alone
        fields["confidence_head_with_markov"] = False
    return fields


def with_heads(drafter: Any, fields: dict[str, Any], seed: int) -> DSparkDrafter:
    """A DSpark drafter on `drafter`'s backbone (its weights, vocabulary and embedding) with fresh heads."""
    config = DSparkConfig(**{**dataclasses.asdict(drafter.config), **fields})
    torch.manual_seed(seed)
    new = DSparkDrafter(config)
    missing, unexpected = new.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected and all(k.startswith(("markov_head.", "confidence_head.")) for k in missing), missing
    new.embed_tokens.weight.requires_grad_(False)
    return new


def check_heads(options: Any, drafter: DSparkDrafter) -> None:
    """Refuse head options that differ from a DSpark `init_from`'s (left at their defaults, they follow it)."""
    defaults = type(options)()
    asked = {name: getattr(options, name) for name in HEAD_OPTIONS
             if getattr(options, name) != getattr(defaults, name)}
    differ = {name: value for name, value in asked.items() if getattr(drafter.config, name) != value}
    if differ:
        own = ", ".join(f"{name}={getattr(drafter.config, name)}" for name in differ)
        raise EaglekitError(f"{', '.join(f'{k}={v}' for k, v in differ.items())}: init_from={options.init_from} is a "
                            f"DSpark drafter with {own}, and fine-tuning keeps its heads; drop the option, or train a "
                            "fresh drafter")


def prepare_dspark(options: Any, target: Any) -> tuple[DSparkDrafter, str]:
    """The DSpark drafter to train and a note on where its vocabulary came from (`target`:
    `eaglekit.training.setup.TrainingTarget`)."""
    drafter, note = prepare_dflash(options, target, DEFAULT_BLOCK_SIZE)
    if isinstance(drafter, DSparkDrafter):
        check_heads(options, drafter)
        return drafter, note
    fields = head_fields(options)
    if options.init_from:
        note += f"; DSpark heads fresh on init_from={options.init_from}'s DFlash backbone"
    return with_heads(drafter, fields, options.seed), note
