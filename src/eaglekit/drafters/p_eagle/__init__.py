"""P-EAGLE drafters: an EAGLE-3 drafter that drafts a whole chain in one forward (positions after the first read a
learned `mask_hidden` and a parallel-drafting token): training (`train`) and drafting (`decode`); the model, its
layouts and its chains and trees are EAGLE-3's. `TYPE` is what `eaglekit.registry` reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglekit.drafters.eagle3 import Eagle3Type
from eaglekit.registry import EngineMarker, Method


class PEagleType(Eagle3Type):
    def prepare(self, options: Any, target: Any) -> tuple[Any, str]:
        from eaglekit.drafters.eagle3.build import prepare_eagle3
        from eaglekit.drafters.p_eagle.train import to_parallel

        drafter, note = prepare_eagle3(options, target)
        return to_parallel(drafter, options.mask_token_id, options.seed), note

    def objective(self, options: Any, drafter: Any, attention: str) -> Any:
        from eaglekit.drafters.p_eagle.train import ParallelModule

        return ParallelModule(drafter, options.ttt_steps, options.step_decay, attention)

    def speculative_method(self, name: str) -> Any:
        from eaglekit.drafters.p_eagle.decode import METHOD

        return METHOD

    def is_checkpoint(self, data: dict[str, Any]) -> bool:
        return False  # EAGLE-3's layouts hold P-EAGLE drafters too: its reader builds them (`mask_hidden`)

    def read_checkpoint(self, source: Path, options: Any) -> Any:
        raise AssertionError("P-EAGLE checkpoints are read by the eagle3 type")

    def planned_config(self, train: Any, target_config: Any, aux_layers: tuple[int, ...]) -> Any | None:
        return None


TYPE = PEagleType(
    name="p-eagle",
    summary="an EAGLE-3 drafter that drafts ttt_steps tokens in one forward (positions after the first read a "
            "learned mask_hidden and a parallel-drafting token; init_from= an eagle3 drafter is the usual recipe)",
    methods=("parallel", "chain", "tree"),
    defines=(Method("parallel", chain=True, summary="a P-EAGLE drafter's chain drafted in one forward"),),
    export_formats=("vllm", "speculators"),
    vllm_method="eagle3",
    engines={"vllm": EngineMarker("vllm/model_executor/models/llama_eagle3.py", '"mask_hidden"',
                                  'speculative_config {"method": "eagle3", "parallel_drafting": true} (Llama-style '
                                  "drafters only: vLLM's MLA drafter takes no parallel drafting)")},
    starts_from="eagle3",
)
