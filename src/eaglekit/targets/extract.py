"""Extracting hidden states: batching tokenised records, running the target with verified hooks, handing the
padding-stripped rows to the shard writer, guarding a resumed store, and the store's manifest.

`eaglekit.stages.extract` parses and validates the options and calls these in order; the store's layout is
`eaglekit.targets.store` (docs/extract.md).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from eaglekit.errors import EaglekitError
from eaglekit.manifest import atomic_write_json, write_manifest
from eaglekit.targets.identity import target_config_hash, tokenizer_hash

if TYPE_CHECKING:  # torch and the capture code are imported by the functions that run, so `--help` stays fast
    import torch

    from eaglekit.targets.capture import HiddenStateCapture
    from eaglekit.targets.shard_writer import ShardWriter
    from eaglekit.targets.store import StoreLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Record:
    id: str
    input_ids: torch.Tensor  # (T,) int64
    loss_mask: torch.Tensor  # (T,) uint8


# ---- pure helpers --------------------------------------------------------------------------------

def make_batches(records: list[Record], batch_tokens: int, max_batch_size: int) -> list[list[Record]]:
    """Longest first (an out-of-memory shows at once), greedy: a batch's padded size B x T_max stays
    within `batch_tokens` (a single longer record goes alone)."""
    ordered = sorted(records, key=lambda r: (-len(r.input_ids), r.id))
    batches: list[list[Record]] = []
    for record in ordered:
        last = batches[-1] if batches else None
        if last and len(last) < max_batch_size and (len(last) + 1) * len(last[0].input_ids) <= batch_tokens:
            last.append(record)
        else:
            batches.append([record])
    return batches


def pad_batch(batch: list[Record], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) ids and attention mask, and the (N,) flat row index of the real tokens."""
    import torch

    longest = max(len(r.input_ids) for r in batch)
    ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    index = []
    for b, record in enumerate(batch):
        n = len(record.input_ids)
        ids[b, :n], mask[b, :n] = record.input_ids, 1
        index.append(torch.arange(n) + b * longest)
    return ids, mask, torch.cat(index)


def resolve_aux_ids(aux_layer_ids: tuple[int, ...], convention: str, num_layers: int,
                    target: str = "") -> tuple[int, ...]:
    """Requested ids in the input-of-layer convention (defaults when none given); checks the range."""
    from eaglekit.targets.capture import default_aux_layers, to_input_convention

    if not aux_layer_ids:  # three distinct layers (refused under 3 layers)
        return default_aux_layers(num_layers)
    ids = to_input_convention(tuple(aux_layer_ids), convention)
    if not ids or len(set(ids)) != len(ids) or not all(0 <= i <= num_layers for i in ids):
        raise EaglekitError(f"aux_layer_ids={list(aux_layer_ids)} ({convention}) must be distinct ids within the "
                            f"target's {num_layers} layers (input_of_layer 0..{num_layers}): 3 for an EAGLE-3 "
                            "drafter, a DFlash drafter's target_layer_ids + 1; omit them for the EAGLE-3 default")
    return ids


# ---- data ----------------------------------------------------------------------------------------

def read_records(paths: tuple[str, ...], tokenizer: Any, max_length: int, chat_template: str = "", limit: int = 0,
                 skip_errors: bool = False) -> tuple[list[Record], dict[str, int]]:
    """The learnable records of the conversation files (the first `limit` conversations when > 0) as tensors,
    and the tokenisation counts (`records_read`, `truncated`, `no_assistant_tokens`, `duplicates`)."""
    import torch

    from eaglekit.data import read_conversations, tokenize_conversations

    conversations = read_conversations(list(paths), skip_errors=skip_errors)
    if limit:
        conversations = conversations[:limit]
    if not conversations:
        raise EaglekitError(f"no conversations in {', '.join(paths)}; check the data files (empty?)")
    tokenized = tokenize_conversations(tokenizer, conversations, max_length, chat_template or None)
    if not tokenized.records:
        prompts_only = not any(m.role == "assistant" for c in conversations for m in c.messages)
        fix = (f"the data holds prompts only: have the target answer them first with `eaglekit regen {paths[0]} "
               "output=DIR target=T` and extract DIR/conversations.jsonl (`eaglekit run` does this with regen in its "
               "stages)" if prompts_only else
               f"check which tokens are learned with `eaglekit inspect {paths[0]} target=T` (or pass chat_template=)")
        raise EaglekitError(f"none of the {len(conversations)} records has assistant tokens to learn from: {fix}")
    records = [Record(r.id, torch.tensor(r.input_ids, dtype=torch.long), torch.tensor(r.loss_mask, dtype=torch.uint8))
               for r in tokenized.records]
    return records, tokenized.stats()


# ---- output directory: identity, resume, distributed ---------------------------------------------

def distributed() -> tuple[int, int]:
    """(rank, world size); initialises torch.distributed under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def rank_device(device_name: str, device_map: str, world: int) -> torch.device:
    """This process's device: `device_name` resolved, or cuda:LOCAL_RANK under torchrun."""
    import torch

    from eaglekit.runtime import resolve_device

    if device_map and world > 1:
        raise EaglekitError("device_map=auto spreads ONE model over the GPUs; with torchrun use one GPU per rank "
                            "(drop device_map)")
    device = resolve_device(device_name)
    if world > 1 and device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return device


def _our_files(out: Path) -> list[Path]:
    from eaglekit.targets.store import RUN_FILE

    names = ("shard-r*.safetensors", "shards-r*.jsonl", ".shard-r*.tmp", RUN_FILE, "manifest.json")
    return [p for pattern in names for p in out.glob(pattern)]


def _claim_output(out: Path, identity: dict[str, Any], overwrite: bool) -> None:
    """Rank 0: refuse a store of a different run (unless overwriting), then record this run's identity."""
    from eaglekit.targets.store import RUN_FILE

    out.mkdir(parents=True, exist_ok=True)
    if overwrite:
        for path in _our_files(out):
            path.unlink()
    previous = json.loads((out / RUN_FILE).read_text()) if (out / RUN_FILE).is_file() else None
    if previous is not None:
        changed = [f"{k}: {previous.get(k)} -> {v}" for k, v in identity.items() if previous.get(k) != v]
        if changed:
            raise EaglekitError(f"{out} holds hidden states from a different run ({', '.join(changed)}); "
                                "pass --overwrite to replace them, or choose a new output directory")
    elif any(out.glob("shard-r*.safetensors")) or any(out.glob("shards-r*.jsonl")):
        raise EaglekitError(f"{out} holds shards without {RUN_FILE}; pass --overwrite or choose a new output directory")
    atomic_write_json(out / RUN_FILE, identity)


def prepare_output(out: Path, identity: dict[str, Any], overwrite: bool, rank: int, world: int) -> set[str]:
    """Guard resume against a different run, clean untrusted files; returns record ids already stored."""
    from eaglekit.targets.store import merge_shard_logs, read_shard_log

    if rank == 0:
        _claim_output(out, identity, overwrite)
    barrier(world)
    done = {record for entry in merge_shard_logs(out) for record in entry["records"]}
    logged = {entry["file"] for entry in read_shard_log(out, rank)}
    for path in list(out.glob(f"shard-r{rank:02d}-*.safetensors")) + list(out.glob(f".shard-r{rank:02d}-*.tmp")):
        if path.name not in logged:  # written but never logged (crash between rename and log): not trusted
            path.unlink()
    return done


def layout_and_identity(target_config: Any, tokenizer: Any, aux_ids: tuple[int, ...], dtype: str, max_length: int,
                        chat_template: str) -> tuple[StoreLayout, dict[str, Any]]:
    """The store's layout and the identity a resumed run must match (`RUN_FILE`, then the manifest)."""
    from eaglekit.layers import INPUT_OF_LAYER
    from eaglekit.targets.capture import text_config
    from eaglekit.targets.store import STORE_FORMAT, StoreLayout

    text = text_config(target_config)
    layout = StoreLayout(hidden_size=text.hidden_size, num_aux=len(aux_ids), dtype=dtype)
    identity = {"format": STORE_FORMAT, "target_config_hash": target_config_hash(target_config),
                "tokenizer_hash": tokenizer_hash(tokenizer), "aux_layer_ids": list(aux_ids),
                "aux_layer_convention": INPUT_OF_LAYER, "dtype": dtype, "max_length": max_length,
                "chat_template": chat_template}
    return layout, identity


# ---- the loop ------------------------------------------------------------------------------------

def batch_states(capture: HiddenStateCapture, index: torch.Tensor, layout: StoreLayout) -> dict[str, torch.Tensor]:
    """Captured (B, T, .) states -> padding-stripped (N, .) rows in the storage dtype, all on the device of
    the first aux state (one device even when device_map spreads the layers)."""
    aux = capture.aux()  # (B, T, 3H)
    final = capture.final().to(aux.device)  # (B, T, H)
    index = index.to(aux.device, non_blocking=True)
    aux = aux.reshape(-1, aux.shape[-1]).index_select(0, index)  # (N, 3H)
    final = final.reshape(-1, final.shape[-1]).index_select(0, index)  # (N, H)
    return storage_rows(aux, final, layout)


def storage_rows(aux: torch.Tensor, final: torch.Tensor, layout: StoreLayout) -> dict[str, torch.Tensor]:
    """(N, 3H) aux and (N, H) final rows -> the store's tensors in its dtype (float8: with per-row scales); every
    backend hands its rows to the shard writer through this."""
    from eaglekit.targets.store import quantize_rows

    if layout.quantized:
        aux_q, aux_scale = quantize_rows(aux, layout.num_aux)
        final_q, final_scale = quantize_rows(final, 1)
        return {"aux": aux_q, "final": final_q, "aux_scale": aux_scale, "final_scale": final_scale}
    return {"aux": aux.to(layout.torch_dtype), "final": final.to(layout.torch_dtype)}


def input_device(model: torch.nn.Module) -> torch.device:
    return model.get_input_embeddings().weight.device


def extract_batches(model: torch.nn.Module, capture: HiddenStateCapture, batches: list[list[Record]],
                    writer: ShardWriter, layout: StoreLayout, pad_id: int, show: bool) -> int:
    """Forward every batch with the hooks on and hand its rows to the writer; returns tokens processed."""
    import torch

    from eaglekit.targets.capture import forward_target
    from eaglekit.targets.verify import check_hook_calls, check_shapes

    device = input_device(model)
    pin = device.type == "cuda"
    total = sum(len(r.input_ids) for batch in batches for r in batch)
    tokens = 0
    with tqdm(total=total, unit="tok", unit_scale=True, desc="extract", disable=not show, smoothing=0.1) as bar:
        for batch in batches:
            ids, mask, index = pad_batch(batch, pad_id)
            if pin:
                ids, mask, index = ids.pin_memory(), mask.pin_memory(), index.pin_memory()
            capture.reset()
            with torch.inference_mode():
                forward_target(model, ids.to(device, non_blocking=True), mask.to(device, non_blocking=True))
                check_hook_calls(capture)
                check_shapes(capture, ids.shape[0], ids.shape[1], layout.hidden_size)
                states = batch_states(capture, index, layout)
            capture.reset()  # drop references to the (B, T, H) activations before the next forward
            writer.add_batch([r.id for r in batch], [r.input_ids for r in batch], [r.loss_mask for r in batch], states)
            tokens += len(index)
            bar.update(len(index))
    return tokens


def verify_first(model: torch.nn.Module, capture: HiddenStateCapture, batches: list[list[Record]]) -> dict[str, Any]:
    """Check the hooks against `output_hidden_states` on (the start of) the first record."""
    import torch

    from eaglekit.targets.verify import verify_capture

    probe = batches[0][0].input_ids[:64][None] if batches else torch.arange(1, 9)[None]  # (1, T)
    return verify_capture(model, capture, probe.to(input_device(model))).to_dict()


def open_writer(out: Path, layout: StoreLayout, rank: int, parallelism: tuple[int, int], *, shard_mb: float,
                batch_tokens: int, pin: bool, metadata: dict[str, str], fsync: bool,
                stats: dict[str, Any]) -> ShardWriter:
    """This rank's background shard writer (after its logged shards); records its size in `stats`."""
    from eaglekit.targets.shard_writer import ShardWriter
    from eaglekit.targets.store import read_shard_log

    threads, buffers = parallelism
    capacity = max(int(shard_mb * 2**20) // layout.bytes_per_token, batch_tokens)  # tokens: at least one batch
    start = max((e["index"] + 1 for e in read_shard_log(out, rank)), default=0)
    writer = ShardWriter(out, layout, capacity, rank=rank, start_index=start, num_buffers=buffers, pin_memory=pin,
                         metadata=metadata, num_threads=threads, fsync=fsync)
    stats.update(writer_threads=threads, buffers=buffers, shard_tokens=capacity,
                 host_buffer_GB=round(writer.host_bytes / 1e9, 3))
    log.info("rank %d: %d writer threads, %d shard buffers of %d tokens (%.2f GB of %s host memory)", rank, threads,
             buffers, capacity, writer.host_bytes / 1e9, "pinned" if pin else "pageable")
    return writer


def write_store_manifest(out: Path, model: torch.nn.Module, decoder_path: str, layout: StoreLayout,
                         identity: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """The store's manifest (written last) from the merged shard logs; `extra` adds the run's own fields
    (target, data, stats, verification, world_size)."""
    return write_manifest_for(out, model.config, type(model).__name__, decoder_path, layout, identity, extra)


def write_manifest_for(out: Path, config: Any, target_class: str, decoder_path: str, layout: StoreLayout,
                       identity: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`write_store_manifest` from the target's config (an HF config, or its config.json as a dict) and class name:
    what a backend that never loads the model in this process (vLLM) knows."""
    from types import SimpleNamespace

    from eaglekit.targets.capture import text_config
    from eaglekit.targets.store import merge_shard_logs

    shards = merge_shard_logs(out)
    if isinstance(config, dict):
        text = SimpleNamespace(**(config.get("text_config") or config))
        architecture = (config.get("architectures") or [target_class])[0]
    else:
        text = text_config(config)
        architecture = (getattr(config, "architectures", None) or [target_class])[0]
    shapes = {"input_ids": ["T"], "loss_mask": ["T"], "aux": ["T", layout.num_aux * layout.hidden_size],
              "final": ["T", layout.hidden_size]}
    storage = {"scale": "per token and layer (float32)" if layout.quantized else None,
               "bytes_per_token": layout.bytes_per_token}
    data = {**identity, "target": extra.get("target"), "target_architecture": architecture,
            "target_class": target_class, "decoder_path": decoder_path, "hidden_size": layout.hidden_size,
            "vocab_size": text.vocab_size, "num_layers": getattr(text, "num_hidden_layers", None),
            "storage": storage, "shapes": shapes, "num_records": sum(len(e["records"]) for e in shards),
            "num_tokens": sum(e["num_tokens"] for e in shards), "bytes": sum(e["bytes"] for e in shards),
            **{k: v for k, v in extra.items() if k != "target"}, "shards": shards}
    write_manifest(out, "extract", data)
    log.info("extract: %d records, %d tokens, %.2f GB in %d shards -> %s", data["num_records"], data["num_tokens"],
             data["bytes"] / 1e9, len(shards), out)
    return data
