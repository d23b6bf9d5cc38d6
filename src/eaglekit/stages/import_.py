"""Import a drafter checkpoint (EAGLE, vLLM, SGLang or speculators layout; any drafter type) into eaglekit.

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
    aux_layer_ids: tuple[int, ...] = option((), "override the aux layer ids (input-of-layer convention)", min=0)
    trust_remote_code: bool = option(False, "allow the target's own config code when reading `target`")
    overwrite: bool = option(False, "write into an output directory that is not empty and was not written by import")


def _target_layers(target: str, trust_remote_code: bool) -> tuple[int | None, str, str]:
    """(num_hidden_layers, name, architecture) of the target, or (None, '', '') when not given."""
    if not target:
        return None, "", ""
    import json

    from eaglekit.targets.capture import text_config

    path = Path(target)
    if path.is_file() and path.suffix == ".json":
        data = json.loads(path.read_text())
        text = data.get("text_config") or data
        return int(text["num_hidden_layers"]), str(path.parent), (data.get("architectures") or [""])[0]
    from eaglekit.targets.loading import load_target_config

    config = load_target_config(target, trust_remote_code=trust_remote_code)
    return int(text_config(config).num_hidden_layers), target, (getattr(config, "architectures", None) or [""])[0]


def run(config: Config) -> dict[str, Any]:
    from eaglekit.formats.files import read_config
    from eaglekit.formats.saved import ImportOptions, checkpoint_type, is_saved_drafter
    from eaglekit.manifest import claim_output, write_errors, write_manifest

    if not config.source:
        raise EaglekitError("no source given: eaglekit import <checkpoint dir> output=<dir>")
    source = Path(config.source)
    output = Path(config.output or f"{source.as_posix().rstrip('/')}-eaglekit")
    data = read_config(source)
    if is_saved_drafter(data):
        raise EaglekitError(f"{source} is already an eaglekit drafter: use it as it is (drafter={source})")
    kind = checkpoint_type(data, source)
    layers, target_name, architecture = _target_layers(config.target, config.trust_remote_code)
    lm_head = None
    if config.target:
        from eaglekit.training.target_weights import load_target_embeddings

        def lm_head() -> Any:  # read only for a checkpoint that drafts with the target's
            return load_target_embeddings(target_name, config.trust_remote_code)[1]
    options = ImportOptions(config.from_format, layers, tuple(config.aux_layer_ids), target_name, architecture,
                            lm_head)
    drafter, fields, message = kind.import_checkpoint(source, output, options)
    if output.resolve() == source.resolve():
        raise EaglekitError("output must differ from the source checkpoint's directory; pass output=<new dir>")
    claim_output(output, "import", config.overwrite)
    (output / "manifest.json").unlink(missing_ok=True)  # its presence means "finished": not while files change
    with write_errors(output, "imported drafter"):
        drafter.save_pretrained(output, include_embedding=bool(drafter.embed_tokens.weight.any()))
        save_resolved(config, output, name="eaglekit_import.yaml")
    summary = {"source": str(source), "output": str(output), **fields}
    write_manifest(output, "import", summary)
    print(message)
    return summary
