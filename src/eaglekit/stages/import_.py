"""Import an EAGLE, vLLM, SGLang or speculators EAGLE-3 drafter checkpoint into eaglekit's format.

    eaglekit import path/to/EAGLE3-LLaMA3.1-Instruct-8B output=runs/imported target=meta-llama/Llama-3.1-8B-Instruct
    eaglekit import runs/export/sglang output=runs/imported from_format=sglang

The layout is detected from config.json. Aux layer ids are converted to eaglekit's input-of-layer
convention; an eagle3-layout checkpoint that names ids in `eagle_config` without saying which engine
wrote it must be told (`from_format=vllm|sglang|eagle`), because the two engines read them one apart.
A checkpoint without ids gets the engine default (2, L/2, L-3), which needs the target (`target=`).
The vocabulary mapping (`d2t`/`t2d`) is kept exactly as published.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglekit.config import option, save_resolved
from eaglekit.errors import EaglekitError
from eaglekit.formats.names import IMPORT_FORMATS

log = logging.getLogger(__name__)

POSITIONAL = ("source",)


@dataclass(frozen=True)
class Config:
    source: str = option("", "drafter checkpoint directory (config.json + model.safetensors or pytorch_model.bin)")
    output: str = option("", "output directory for the eaglekit drafter (default: <source>-eaglekit)")
    from_format: str = option("auto", "layout/engine that wrote the checkpoint", choices=IMPORT_FORMATS)
    target: str = option("", "target model (dir, config.json or hub id): its layer count gives default aux layers")
    aux_layer_ids: tuple[int, ...] = option((), "override the aux layer ids (input-of-layer convention)")
    trust_remote_code: bool = option(False, "allow the target's own config code when reading `target`")
    overwrite: bool = option(False, "write into an output directory that is not empty and was not written by import")


def _target_layers(target: str, trust_remote_code: bool) -> tuple[int | None, str, str]:
    """(num_hidden_layers, name, architecture) of the target, or (None, '', '') when not given."""
    if not target:
        return None, "", ""
    import json

    from eaglekit.target.capture import text_config

    path = Path(target)
    if path.is_file() and path.suffix == ".json":
        data = json.loads(path.read_text())
        text = data.get("text_config") or data
        return int(text["num_hidden_layers"]), str(path.parent), (data.get("architectures") or [""])[0]
    from eaglekit.target.loading import load_target_config

    config = load_target_config(target, trust_remote_code=trust_remote_code)
    return int(text_config(config).num_hidden_layers), target, (getattr(config, "architectures", None) or [""])[0]


def run(config: Config) -> dict[str, Any]:
    from eaglekit.drafters.eagle3.model import DrafterConfig
    from eaglekit.drafters.eagle3.convert import import_checkpoint
    from eaglekit.manifest import claim_output, write_errors, write_manifest

    if not config.source:
        raise EaglekitError("no source given: eaglekit import <checkpoint dir> output=<dir>")
    source = Path(config.source)
    output = Path(config.output or f"{source.as_posix().rstrip('/')}-eaglekit")
    from eaglekit.drafters.dflash.formats import is_dflash_checkpoint
    from eaglekit.drafters.eagle3.formats import read_config

    if is_dflash_checkpoint(read_config(source)):
        return _run_dflash(config, source, output)
    layers, target_name, architecture = _target_layers(config.target, config.trust_remote_code)
    drafter = import_checkpoint(source, config.from_format, layers, config.aux_layer_ids or None)
    data = drafter.config.to_dict()
    if target_name:
        data.update(target_name_or_path=target_name, target_architecture=architecture or data["target_architecture"])
        if layers and max(drafter.config.aux_layer_ids) > layers:
            raise EaglekitError(
                f"aux layer ids {drafter.config.aux_layer_ids} exceed the target's {layers} layers: wrong target?"
            )
    drafter.config = DrafterConfig.from_dict(data)
    if output.resolve() == source.resolve():
        raise EaglekitError("output must differ from the source checkpoint's directory; pass output=<new dir>")
    claim_output(output, "import", config.overwrite)
    (output / "manifest.json").unlink(missing_ok=True)  # its presence means "finished": not while files change
    with write_errors(output, "imported drafter"):
        drafter.save_pretrained(output, include_embedding=bool(drafter.embed_tokens.weight.any()))
        save_resolved(config, output, name="eaglekit_import.yaml")
    summary = {
        "source": str(source),
        "output": str(output),
        "aux_layer_ids": list(drafter.config.aux_layer_ids),
        "aux_layer_convention": drafter.config.aux_layer_convention,
        "draft_vocab_size": drafter.config.draft_vocab_size,
        "has_embedding": bool(drafter.embed_tokens.weight.any()),
    }
    write_manifest(output, "import", summary)
    print(
        f"imported {source} -> {output}; aux layers (input-of-layer) {summary['aux_layer_ids']}"
        + ("" if summary["has_embedding"] else "; no embedding in the checkpoint: load the target's before use")
    )
    return summary


def _run_dflash(config: Config, source: Path, output: Path) -> dict[str, Any]:
    """A DFlash drafter in vLLM's or speculators' layout (a published z-lab checkpoint: no lm_head, it drafts with
    the target's, which `target=` gives) -> eaglekit's DFlash format."""
    from eaglekit.drafters.dflash.model import DFlashConfig
    from eaglekit.drafters.dflash.formats import import_dflash
    from eaglekit.manifest import claim_output, write_errors, write_manifest

    if config.aux_layer_ids:
        raise EaglekitError("aux_layer_ids= overrides EAGLE-3 layers; a DFlash checkpoint names its own "
                            "target_layer_ids: drop aux_layer_ids")
    head = None
    layers, target_name, architecture = _target_layers(config.target, config.trust_remote_code)
    if config.target:
        from eaglekit.drafters.eagle3.build import load_target_embeddings

        head = load_target_embeddings(target_name, config.trust_remote_code)[1]
    drafter = import_dflash(source, lm_head=head)
    if not bool(drafter.lm_head.weight.any()):
        raise EaglekitError(f"{source} has no lm_head: it drafts with the target's, so pass target=MODEL")
    data = drafter.config.to_dict()
    if target_name:
        if layers and max(drafter.config.target_layer_ids) >= layers:
            raise EaglekitError(f"target_layer_ids {list(drafter.config.target_layer_ids)} exceed the target's "
                                f"{layers} layers: wrong target?")
        data.update(target_name_or_path=target_name, target_architecture=architecture or data["target_architecture"],
                    target_num_layers=layers or data["target_num_layers"])
    drafter.config = DFlashConfig.from_dict(data)
    if output.resolve() == source.resolve():
        raise EaglekitError("output must differ from the source checkpoint's directory; pass output=<new dir>")
    claim_output(output, "import", config.overwrite)
    (output / "manifest.json").unlink(missing_ok=True)
    with write_errors(output, "imported drafter"):
        drafter.save_pretrained(output, include_embedding=bool(drafter.embed_tokens.weight.any()))
        save_resolved(config, output, name="eaglekit_import.yaml")
    summary = {"source": str(source), "output": str(output), "drafter_type": "dflash",
               "target_layer_ids": list(drafter.config.target_layer_ids), "block_size": drafter.config.block_size,
               "mask_token_id": drafter.config.mask_token_id, "draft_vocab_size": drafter.config.draft_vocab_size,
               "lm_head_from_target": head is not None}
    write_manifest(output, "import", summary)
    print(f"imported DFlash drafter {source} -> {output}; target layers (output-of-layer) "
          f"{summary['target_layer_ids']}, block {summary['block_size']}")
    return summary
