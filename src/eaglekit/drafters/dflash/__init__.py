"""DFlash drafters (block diffusion): a few Qwen3-style layers that denoise a block of mask tokens in one non-causal
forward, conditioned on the target's states injected as keys/values. The model (`model`), training blocks and loss
(`train`, `setup`), drafting (`decode`, `static`) and the engines' layouts (`formats`). `TYPE` is what
`eaglekit.registry` reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglekit.registry import DrafterType, EngineMarker, Method


class DFlashType(DrafterType):
    def drafter_class(self) -> Any:
        from eaglekit.drafters.dflash.model import DFlashDrafter

        return DFlashDrafter

    def prepare(self, options: Any, target: Any) -> tuple[Any, str]:
        from eaglekit.drafters.dflash.setup import prepare_dflash

        return prepare_dflash(options, target)

    def objective(self, options: Any, drafter: Any, attention: str) -> Any:
        from eaglekit.drafters.dflash.train import DFlashObjective

        return DFlashObjective(drafter, options.num_anchors, options.step_decay, attention, options.seed)

    def speculative_method(self, name: str) -> Any:
        from eaglekit.drafters.dflash.decode import METHOD

        return METHOD

    def check_drafts(self, config: Any, num_drafts: int) -> None:
        from eaglekit.drafters.dflash.model import check_block

        check_block(num_drafts, config.block_size)

    def export(self, drafter: Any, output: Path, fmt: str, dtype: Any = None, include_embedding: bool = True,
               speculative_tokens: int = 3) -> dict[str, Any]:
        from eaglekit.drafters.dflash.formats import export_dflash

        return export_dflash(drafter, output, fmt, dtype=dtype)  # never the embedding: the engines share it

    def export_note(self, summary: dict[str, Any], source: Path, output: Path) -> str:
        from eaglekit.drafters.dflash.formats import export_note

        return export_note(summary, source, output)

    def is_checkpoint(self, data: dict[str, Any]) -> bool:
        from eaglekit.drafters.dflash.formats import is_dflash_checkpoint

        return is_dflash_checkpoint(data)

    def read_checkpoint(self, source: Path, options: Any) -> Any:
        from eaglekit.drafters.dflash.formats import import_dflash

        return import_dflash(source, lm_head=options.lm_head() if options.lm_head is not None else None)

    def import_checkpoint(self, source: Path, output: Path, options: Any) -> tuple[Any, dict[str, Any], str]:
        from eaglekit.drafters.dflash.formats import import_for_target

        return import_for_target(source, output, options)

    def vllm_speculative_config(self, checkpoint: dict[str, Any], model: str) -> dict[str, Any]:
        from eaglekit.drafters.dflash.model import DEFAULT_BLOCK_SIZE

        drafts = int(checkpoint.get("block_size") or DEFAULT_BLOCK_SIZE) - 1  # the whole block
        return {**super().vllm_speculative_config(checkpoint, model), "num_speculative_tokens": drafts}

    def bench_options(self, train: Any) -> dict[str, Any]:
        from eaglekit.drafters.dflash.model import DEFAULT_BLOCK_SIZE

        return {"chain_length": (train.block_size or DEFAULT_BLOCK_SIZE) - 1}  # the whole block


TYPE = DFlashType(
    name="dflash",
    summary="block diffusion drafter: block_size - 1 drafts from one non-causal forward",
    methods=("dflash",),
    defines=(Method("dflash", chain=True, summary="a DFlash drafter's block, drafted in one non-causal forward"),),
    export_formats=("vllm", "speculators"),
    vllm_method="dflash",
    engines={"vllm": EngineMarker("vllm/model_executor/models/registry.py", '"DFlashDraftModel"',
                                  'speculative_config {"method": "dflash"}')},
)
