"""Export a trained drafter for a serving engine: vLLM, SGLang or speculators layout, verified by re-import.

    eaglekit export runs/drafter --to vllm output=runs/export/vllm
    eaglekit export runs/drafter --to sglang output=runs/export/sglang dtype=bf16
    eaglekit export runs/drafter --to speculators output=runs/export/spec

The exporter refuses drafters the engine would load with different behaviour (missing `d2t`, an
SGLang export of a norm_before_residual drafter, ...), converts the aux layer ids to the engine's
convention (vLLM: input of layer, as eaglekit; SGLang: output of layer = ours - 1) and writes them
where that engine reads them. The written checkpoint is re-read and its logits on a probe input
compared with the source drafter before the command reports success (`manifest.json` written last). A folder
that holds another export (another format, drafter or options) is replaced only with overwrite=true.
"""

from __future__ import annotations

import json
import logging
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglekit.config import option, save_resolved
from eaglekit.errors import EaglekitError
from eaglekit.formats.names import EXPORT_FORMATS

log = logging.getLogger(__name__)

POSITIONAL = ("drafter",)
DTYPES = ("keep", "bf16", "fp16", "fp32")


@dataclass(frozen=True)
class Config:
    drafter: str = option("", "eaglekit drafter directory (config.json + model.safetensors), e.g. runs/drafter")
    to: str = option("vllm", "checkpoint layout to write", choices=EXPORT_FORMATS)
    output: str = option("", "output directory (default: <drafter>-<to>)")
    dtype: str = option("keep", "weight dtype of the written checkpoint", choices=DTYPES)
    include_embedding: bool = option(True, "write embed_tokens.weight (off: the engine shares the target's embedding)")
    speculative_tokens: int = option(3, "speculators only: speculative_tokens of the greedy proposal method", min=1)
    overwrite: bool = option(False, "write into an output directory that is not empty and was not written by export, "
                                    "or that holds another export (another format, drafter or options)")


def _made_from(config: Config, source: Path) -> dict[str, Any]:
    """What an export is of: format, drafter (folder and weights) and the options that change the files written."""
    from eaglekit.manifest import file_sha256

    weights = source / "model.safetensors"
    return {"format": config.to, "drafter": str(source.resolve()),
            "drafter_sha256": file_sha256(weights) if weights.is_file() else None, "dtype": config.dtype,
            "include_embedding": config.include_embedding, "speculative_tokens": config.speculative_tokens}


def _check_replacing(output: Path, made_from: dict[str, Any], overwrite: bool) -> None:
    """A folder holding another finished export (another format, drafter or options) is replaced only with
    overwrite=true; exporting the same drafter the same way again is allowed."""
    from eaglekit.manifest import read_manifest

    previous = read_manifest(output) if output.is_dir() else None
    if overwrite or not previous or previous.get("stage") != "export" or previous.get("made_from") == made_from:
        return
    before = previous.get("made_from")
    differs = f", other {', '.join(k for k in made_from if before.get(k) != made_from[k])}" if before else ""
    raise EaglekitError(
        f"output {output} holds another export (the {previous.get('summary', {}).get('format', '?')} export of "
        f"{previous.get('source', '?')}{differs}): choose a new output directory, or pass overwrite=true to replace it"
    )


def run(config: Config) -> dict[str, Any]:
    import torch

    from eaglekit import registry
    from eaglekit.formats.saved import load_saved_drafter, saved_drafter_type
    from eaglekit.manifest import claim_output, file_sha256, write_errors, write_manifest

    if not config.drafter:
        raise EaglekitError("no drafter given: eaglekit export <drafter dir> --to vllm|sglang|speculators")
    source = Path(config.drafter)
    output = Path(config.output or f"{source.as_posix().rstrip('/')}-{config.to}")
    if output.resolve() == source.resolve():
        raise EaglekitError("output must differ from the drafter directory; pass output=<new dir>")
    kind = registry.get(saved_drafter_type(source))
    if config.to not in kind.export_formats:
        layouts = " or --to ".join(kind.export_formats)
        raise EaglekitError(f"{source} is a {kind.name} drafter: it exports --to {layouts} ({config.to} serves no "
                            f"{kind.name} drafter)")
    drafter = load_saved_drafter(source)
    made_from = _made_from(config, source)
    _check_replacing(output, made_from, config.overwrite)
    claim_output(output, "export", config.overwrite)
    (output / "manifest.json").unlink(missing_ok=True)  # its presence means "finished": not while files change
    dtype = {"keep": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[config.dtype]
    with write_errors(output, "exported checkpoint"):
        summary = kind.export(drafter, output, config.to, dtype=dtype, include_embedding=config.include_embedding,
                              speculative_tokens=config.speculative_tokens)
        save_resolved(config, output, name="eaglekit_export.yaml")
        write_manifest(output, "export", {"source": str(source), "made_from": made_from, "summary": summary,
                                          "weights_sha256": file_sha256(output / "model.safetensors")})
    log.info("wrote %s checkpoint of a %s drafter to %s (probe logits max diff %.3g)", config.to, kind.name, output,
             summary["max_logit_difference"])
    print(kind.export_note(summary, source, output))
    served = kind.vllm_speculative_config(json.loads((output / "config.json").read_text()), str(output))
    if served and config.to == "vllm":
        print(f"serve: vllm serve TARGET --speculative-config {shlex.quote(json.dumps(served))}")
    if config.to == "vllm":  # what vLLM checks of the target when it loads the drafter, where this vLLM can be read
        from eaglekit.doctor.diagnose import vllm_serving_note

        note = vllm_serving_note(drafter.config.target_name_or_path, drafter.config.target_architecture)
        if note:
            log.warning("%s", note)
    return summary
