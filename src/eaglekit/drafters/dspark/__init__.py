"""DSpark drafters (DeepSeek's DeepSpec): DFlash's block backbone with a Markov head (each draft corrected by the one
before it, left to right) and a confidence head (how far the drafts will survive), calibrated per position after
training. The model (`model`), training (`train`, `setup`, `calibration`), drafting (`decode`, `static`) and the
engines' layouts (`formats`). `TYPE` is what `eaglekit.registry` reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglekit.drafters.dflash import DFlashType
from eaglekit.registry import EngineMarker, Method


CUT_SWEEP = (0.3, 0.6)  # the confidence cuts a run's bench measures beside the uncut chain


class DSparkType(DFlashType):
    def drafter_class(self) -> Any:
        from eaglekit.drafters.dspark.model import DSparkDrafter

        return DSparkDrafter

    def prepare(self, options: Any, target: Any) -> tuple[Any, str]:
        from eaglekit.drafters.dspark.setup import prepare_dspark

        return prepare_dspark(options, target)

    def objective(self, options: Any, drafter: Any, attention: str) -> Any:
        from eaglekit.drafters.dspark.train import DSparkObjective

        return DSparkObjective(drafter, options.num_anchors, options.step_decay, attention, options.seed)

    def after_training(self, options: Any, drafter: Any, batches: Any) -> dict[str, Any]:
        from eaglekit.drafters.dspark.calibration import calibrate

        return calibrate(drafter, batches(), options.num_anchors, options.seed)

    def speculative_method(self, name: str) -> Any:
        from eaglekit.drafters.dspark.decode import METHOD

        return METHOD

    def check_drafts(self, config: Any, num_drafts: int) -> None:
        from eaglekit.drafters.dspark.model import check_drafts

        check_drafts(num_drafts, config)

    def check_exportable(self, config: Any, fmt: str) -> None:
        from eaglekit.drafters.dspark.formats import check_exportable

        check_exportable(config, fmt)

    def export(self, drafter: Any, output: Path, fmt: str, dtype: Any = None, include_embedding: bool = True,
               speculative_tokens: int = 3) -> dict[str, Any]:
        from eaglekit.drafters.dspark.formats import export_dspark

        return export_dspark(drafter, output, fmt, dtype=dtype)  # never the embedding: the engines share it

    def export_note(self, summary: dict[str, Any], source: Path, output: Path) -> str:
        from eaglekit.drafters.dspark.formats import export_note

        return export_note(summary, source, output)

    def is_checkpoint(self, data: dict[str, Any]) -> bool:
        from eaglekit.drafters.dspark.formats import is_dspark_checkpoint

        return is_dspark_checkpoint(data)

    def read_checkpoint(self, source: Path, options: Any) -> Any:
        from eaglekit.drafters.dspark.formats import import_dspark

        return import_dspark(source, lm_head=options.lm_head() if options.lm_head is not None else None)

    def import_checkpoint(self, source: Path, output: Path, options: Any) -> tuple[Any, dict[str, Any], str]:
        from eaglekit.drafters.dspark.formats import import_for_target

        return import_for_target(source, output, options)

    def vllm_speculative_config(self, checkpoint: dict[str, Any], model: str) -> dict[str, Any]:
        from eaglekit.drafters.dspark.model import DEFAULT_BLOCK_SIZE

        block = int(checkpoint.get("block_size") or DEFAULT_BLOCK_SIZE)  # every slot drafts, the anchor's too
        drafts = block if checkpoint.get("sample_from_anchor", True) else block - 1
        return {**super().vllm_speculative_config(checkpoint, model), "num_speculative_tokens": drafts}

    def bench_options(self, train: Any) -> dict[str, Any]:
        from eaglekit.drafters.dspark.model import DEFAULT_BLOCK_SIZE

        block = train.block_size or DEFAULT_BLOCK_SIZE
        chosen = {"chain_length": block if train.sample_from_anchor else block - 1}  # the whole block
        return {**chosen, "verify_thresholds": CUT_SWEEP} if train.confidence_head else chosen


TYPE = DSparkType(
    name="dspark",
    summary="DFlash's block backbone with a Markov head (drafts corrected left to right) and a calibrated "
            "confidence head",
    methods=("dspark",),
    defines=(Method("dspark", chain=True, summary="a DSpark drafter's block, corrected left to right by its Markov "
                    "head"),),
    export_formats=("vllm", "speculators"),
    vllm_method="dspark",
    engines={"vllm": EngineMarker("vllm/model_executor/models/registry.py", '"Qwen3DSparkModel"',
                                  'speculative_config {"method": "dspark"} (the GPU model runner; vLLM\'s CPU build '
                                  "refuses DSpark)")},
)
