"""EAGLE-3 drafters (with the MLA midlayer and the norm_before_fc / 3.1 variants): one token per drafter forward,
trained with training-time test. The model (`config`, `layers`, `model`; the MLA midlayer in `mla`), TTT as pure
functions (`ttt`), building one for a target (`build`), drafting chains and trees (`decode`, `static`) and the
engines' checkpoint layouts (`formats`, `mla_format`, `convert`). `TYPE` is what `eaglekit.registry` reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglekit.registry import DrafterType, EngineMarker, Method


class Eagle3Type(DrafterType):
    def drafter_class(self) -> Any:
        from eaglekit.drafters.eagle3.model import Eagle3Drafter

        return Eagle3Drafter

    def prepare(self, options: Any, target: Any) -> tuple[Any, str]:
        from eaglekit.drafters.eagle3.build import prepare_drafter

        return prepare_drafter(options, target)

    def objective(self, options: Any, drafter: Any, attention: str) -> Any:
        from eaglekit.drafters.eagle3.ttt import TTTModule

        return TTTModule(drafter, options.ttt_steps, options.step_decay, attention)

    def speculative_method(self, name: str) -> Any:
        from eaglekit.drafters.eagle3.decode import METHODS

        return METHODS[name]

    def check_exportable(self, config: Any, fmt: str) -> None:
        from eaglekit.drafters.eagle3.formats import check_exportable

        check_exportable(config, fmt)

    def export(self, drafter: Any, output: Path, fmt: str, dtype: Any = None, include_embedding: bool = True,
               speculative_tokens: int = 3) -> dict[str, Any]:
        from eaglekit.drafters.eagle3.convert import export_drafter

        return export_drafter(drafter, output, fmt, dtype, include_embedding, speculative_tokens)

    def export_note(self, summary: dict[str, Any], source: Path, output: Path) -> str:
        from eaglekit.drafters.eagle3.convert import export_note

        return export_note(summary, source, output)

    def vllm_speculative_config(self, checkpoint: dict[str, Any], model: str) -> dict[str, Any]:
        """EAGLE-3's layouts hold P-EAGLE drafters too: vLLM's layout marks them, speculators' names type peagle."""
        parallel = checkpoint.get("parallel_drafting") or checkpoint.get("speculators_model_type") == "peagle"
        served = super().vllm_speculative_config(checkpoint, model)
        return {**served, "parallel_drafting": True} if parallel else served

    def is_checkpoint(self, data: dict[str, Any]) -> bool:
        from eaglekit.drafters.eagle3.formats import is_eagle3_checkpoint

        return is_eagle3_checkpoint(data)

    def read_checkpoint(self, source: Path, options: Any) -> Any:
        from eaglekit.drafters.eagle3.convert import read_checkpoint

        return read_checkpoint(source, options)

    def import_checkpoint(self, source: Path, output: Path, options: Any) -> tuple[Any, dict[str, Any], str]:
        from eaglekit.drafters.eagle3.convert import import_for_target

        return import_for_target(source, output, options)

    def planned_config(self, train: Any, target_config: Any, aux_layers: tuple[int, ...]) -> Any | None:
        from eaglekit.drafters.eagle3.build import planned_config

        return planned_config(train, target_config, aux_layers)


TYPE = Eagle3Type(
    name="eagle3",
    summary="one token per drafter forward, training-time test loss",
    methods=("chain", "tree"),
    defines=(Method("tree", chain=False, summary="an EAGLE-2 dynamic tree, one drafter forward per level"),
             Method("chain", chain=True, summary="a chain of chain_length drafts, one drafter forward each")),
    export_formats=("vllm", "sglang", "speculators"),
    vllm_method="eagle3",
    saved_formats=("eaglekit-eagle3",),
    engines={"vllm": EngineMarker("vllm/model_executor/models/llama_eagle3.py", "class Eagle3LlamaForCausalLM",
                                  'speculative_config {"method": "eagle3"}'),
             "sglang": EngineMarker("sglang/srt/models/llama_eagle3.py", "class LlamaForCausalLMEagle3",
                                    "--speculative-algorithm EAGLE3")},
)
