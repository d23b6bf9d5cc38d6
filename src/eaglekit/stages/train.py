"""Train a drafter (EAGLE-3 with training-time test, or another drafter_type), offline from extract shards or online.

    eaglekit train target=PATH shards=runs/extract output=runs/drafter            # offline
    eaglekit train target=PATH data=train.jsonl output=runs/drafter               # online (no disk)
    eaglekit train target=PATH data=new.jsonl init_from=DRAFTER epochs=5 lr=5e-5  # fine-tune
    eaglekit train target=BIG data=train.jsonl device_map=auto output=...         # online, target over all GPUs
    torchrun --nproc-per-node 8 -m eaglekit train ... [distributed=fsdp]           # several GPUs

Writes the drafter (`config.json`, `model.safetensors`), `vocab.safetensors`, `metrics.jsonl`,
`config.yaml` and `manifest.json` into `output`; checkpoints under `output/checkpoints/`.
"""

from __future__ import annotations

from typing import Any

from eaglekit.config.train import TrainConfig

Config = TrainConfig  # the options live with the library (eaglekit.config.train); the CLI builds them


def run(config: Config) -> dict[str, Any]:
    from eaglekit.training.loop import train

    return train(config)  # init_from in any layout a drafter type reads
