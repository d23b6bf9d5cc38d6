"""Setting up a training run: the target (config, embedding, lm_head; the model itself online), the data
source (extract shards or conversations), the drafter, the identity checks between them, and writing the
finished drafter with its manifest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from eaglekit import registry
from eaglekit.errors import EaglekitError
from eaglekit.formats.saved import check_drafter_target, load_drafter
from eaglekit.layers import INPUT_OF_LAYER
from eaglekit.training.data import OfflineSource, OnlineSource, conversation_records, shard_tokens
from eaglekit.training.target_weights import load_target_embeddings, load_target_head_bias
from eaglekit.training.vocab import VOCAB_FILE, count_tokens, mapping_from_drafter, save_vocab

log = logging.getLogger(__name__)
DrafterReader = Callable[[str, int], Any]  # (directory, the target's layer count) -> drafter


@dataclass(frozen=True)
class TrainingTarget:
    """What a drafter type's `prepare` hook knows of the target and the data when it builds the drafter to train."""

    text_config: Any  # the target's (text) config
    architecture: str  # its architectures[0]
    aux_layers: tuple[int, ...]  # input-of-layer ids a fresh EAGLE-3 drafter fuses (() with init_from: its own)
    count_tokens: Callable[[], torch.Tensor]  # (V,) assistant-token counts of the training data (computed once)
    lm_head: Callable[[], torch.Tensor]  # the target's lm_head (V, H)
    store_aux_ids: tuple[int, ...] | None  # the extract store's input-of-layer ids (offline), None online
    read_drafter: DrafterReader  # reads `init_from`, any layout


def _check(config: Any, world: int) -> None:
    from eaglekit.config import check_options

    check_options(config)  # each option within its declared range (the CLI's load_config checked them already)
    if not config.output:
        raise EaglekitError("no output directory: pass output=DIR")
    if not config.target:
        raise EaglekitError("no target: pass target=PATH (the model the drafter serves), or target=tiny")
    if bool(config.shards) == bool(config.data):
        raise EaglekitError("give exactly one data source: shards=DIR (offline, from `eaglekit extract`) "
                            "or data=FILES (online)")
    if config.device_map and config.shards:
        raise EaglekitError(f"device_map={config.device_map} places the target for online training; "
                            "offline training (shards=) never loads the target: drop device_map")
    if config.device_map and world > 1:
        raise EaglekitError(f"device_map={config.device_map} spreads ONE target over the GPUs of one "
                            f"process, but this is one of {world} torchrun processes: run train as a single process "
                            "(no torchrun), or drop device_map")
    if config.device_map:
        import importlib.util

        from eaglekit.extras import install_hint

        if importlib.util.find_spec("accelerate") is None:
            raise EaglekitError(f"device_map={config.device_map} needs the `accelerate` package, which is not "
                                f"installed: {install_hint('accelerate')}")
    if config.init_std > 0 and config.init_from:
        raise EaglekitError(f"init_std={config.init_std} initialises a fresh drafter, but "
                            f"init_from={config.init_from} brings its own weights: drop one of them")
    if config.fc_norm and config.norm_before_fc:
        raise EaglekitError("fc_norm and norm_before_fc are mutually exclusive (one norm per aux "
                            "state, or one over their concatenation): set one of them to false")
    if config.resume is False and (Path(config.output) / "checkpoints" / "latest.json").is_file():
        raise EaglekitError(f"{config.output} holds checkpoints of an earlier run: pass resume=true to continue "
                            "it, or use a new output")


def _tokenizer_hash(config: Any) -> str | None:
    from eaglekit.targets.identity import tokenizer_hash
    from eaglekit.targets.loading import load_tokenizer

    try:
        return tokenizer_hash(load_tokenizer(config.target, trust_remote_code=config.trust_remote_code))
    except EaglekitError:
        log.warning("target %s has no loadable tokenizer: the shards' tokenizer cannot be checked", config.target)
        return None


def setup(config: Any, d: Any, stack: contextlib.ExitStack,
          read_drafter: DrafterReader = load_drafter) -> tuple[Any, Any, dict[str, Any]]:
    """(drafter with vocab and target embedding, data source, identity for the manifest); the drafter is what
    `config.drafter_type`'s `prepare` hook builds, `read_drafter` loads `init_from`."""
    from eaglekit.runtime import resolve_dtype
    from eaglekit.targets.capture import HiddenStateCapture, default_aux_layers, text_config, to_input_convention
    from eaglekit.targets.identity import target_config_hash, target_weights_hash
    from eaglekit.targets.loading import load_target, load_target_config, load_tokenizer
    from eaglekit.targets.output_head import logit_transform

    _check(config, d.world)
    if d.main:
        from eaglekit.manifest import claim_output

        claim_output(config.output, "train", config.overwrite)
    target_config = load_target_config(config.target, trust_remote_code=config.trust_remote_code)
    tc = text_config(target_config)
    architecture = (getattr(target_config, "architectures", None) or [type(target_config).__name__])[0]
    target = None
    if config.shards:
        from eaglekit.targets.store import HiddenStateDataset

        dataset = HiddenStateDataset(config.shards)
        tokens = shard_tokens(dataset)
        embed, head = load_target_embeddings(config.target, config.trust_remote_code)
    else:
        target = load_target(config.target, d.device, resolve_dtype("auto", d.device),
                             trust_remote_code=config.trust_remote_code,
                             device_map=config.device_map or None)
        tokenizer = load_tokenizer(config.target, trust_remote_code=config.trust_remote_code)
        records = conversation_records(config.data, tokenizer, config.max_length, config.chat_template,
                                       config.skip_errors)
        if not records:
            raise EaglekitError(f"no assistant tokens in DATA: {', '.join(config.data)}: no "
                                "conversation has an assistant answer to learn from after the chat template; have "
                                f"the target answer prompts alone with `eaglekit regen {config.data[0]} output=DIR "
                                f"target={config.target}` (then train on DIR/conversations.jsonl); else check the "
                                f"roles with `eaglekit inspect {config.data[0]} target={config.target}` (or pass "
                                "chat_template=)")
        tokens = [(r["input_ids"], r["loss_mask"]) for r in records]
        embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    counts = functools.cache(lambda: count_tokens(tokens, int(tc.vocab_size)))
    aux_layers = tuple(config.aux_layer_ids) or (() if config.init_from
                                                 else default_aux_layers(int(tc.num_hidden_layers)))
    store_ids = (to_input_convention(tuple(dataset.manifest["aux_layer_ids"]), dataset.manifest["aux_layer_convention"])
                 if config.shards else None)
    target_facts = TrainingTarget(tc, architecture, aux_layers, counts, lambda: head, store_ids, read_drafter)
    drafter, vocab_note = registry.get(config.drafter_type).prepare(config, target_facts)
    weights = target_weights_hash(embed, head)
    if config.init_from:
        check_drafter_target(drafter.config, target_config, config.init_from, config.target, weights)
    drafter.config = dataclasses.replace(drafter.config, target_weights_hash=weights)  # saved with the drafter
    drafter.load_target_embedding(embed.detach().float().cpu())
    if not config.init_from and config.lm_head_init == "target":
        drafter.load_target_lm_head(head.detach())  # copies only the draft vocabulary's rows
    drafter.lm_head.weight.requires_grad_(not config.freeze_lm_head)
    log.info("draft vocabulary %d ids: %s", drafter.config.draft_vocab_size, vocab_note)
    aux_input = to_input_convention(drafter.config.aux_layer_ids, drafter.config.aux_layer_convention)
    if config.shards:
        dataset.validate(hidden_size=int(tc.hidden_size), aux_layer_ids=aux_input, aux_layer_convention=INPUT_OF_LAYER,
                         tokenizer_hash=_tokenizer_hash(config), target_config_hash=target_config_hash(target_config))
        # no bf16 matmuls on CPU
        head = head.detach().to(d.device, torch.float32 if d.device.type == "cpu" else head.dtype)
        bias = load_target_head_bias(config.target, config.trust_remote_code)
        source: Any = OfflineSource(dataset, tokens, head, drafter.t2d, config.max_length,
                                    logit_transform(target_config, bias))
    else:
        capture = stack.enter_context(HiddenStateCapture(target, aux_input))
        source = OnlineSource(records, target, capture, drafter.t2d, config.max_length)
    identity = {"target": config.target, "target_architecture": architecture,
                "target_config_hash": target_config_hash(target_config), "target_weights_hash": weights,
                "mode": "offline" if config.shards else "online", "aux_layer_ids": list(aux_input),
                "aux_layer_convention": INPUT_OF_LAYER, "vocab": vocab_note, "init_from": config.init_from or None}
    return drafter, source, identity


def finish(config: Any, trainer: Any, state: dict[str, torch.Tensor], identity: dict[str, Any],
           result: dict[str, Any]) -> None:
    """Write the final drafter, its vocabulary and the manifest (last) into `output`."""
    from eaglekit.config import to_dict
    from eaglekit.manifest import file_sha256, write_manifest

    output = Path(config.output)
    trainer.save_drafter(output, state)
    save_vocab(output / VOCAB_FILE, mapping_from_drafter(trainer.drafter))
    write_manifest(output, "train", {"config": to_dict(config), **identity, **result,
                                     "drafter_config": trainer.drafter.config.to_dict(),
                                     "sha256": {"model.safetensors": file_sha256(output / "model.safetensors")}})
    val = result.get("val") or {}
    if val:
        print(f"drafter saved to {output}: val loss {val['loss']:.4f}, accuracy per TTT position "
              f"{', '.join(f'{a:.3f}' for a in val['acc_k'])}, estimated tau {val['tau']:.2f}")
    else:
        print(f"drafter saved to {output} after {result['steps']} steps (no validation split)")


