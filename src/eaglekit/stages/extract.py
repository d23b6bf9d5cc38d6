"""Run the target over tokenised conversations and store its aux and final hidden states for training.

    eaglekit extract data.jsonl output=runs/hidden target=meta-llama/Llama-3.1-8B-Instruct
    torchrun --nproc-per-node 8 -m eaglekit extract data.jsonl output=runs/hidden target=...   # data-parallel
    eaglekit extract data.jsonl output=runs/hidden target=big-model device_map=auto             # one model, many GPUs

Per record the store holds token ids, loss mask, the states entering decoder layers `aux_layer_ids`
(input_of_layer convention, default 2, L//2, L-3) and the final-norm output (what the lm_head reads).
Batches are length-sorted and right-padded; padding is stripped before storing. Shards are bounded,
written atomically by background threads (as many as the cores allow, see `writer_parallelism`), and
logged; a re-run resumes after the last complete shard.
See docs/extract.md for the layout (`eaglekit.target.store`) and `HiddenStateDataset` for reading it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from eaglekit.config import option, save_resolved
from eaglekit.errors import EaglekitError
from eaglekit.manifest import atomic_write_json, write_manifest
from eaglekit.target.identity import target_config_hash, tokenizer_hash

if TYPE_CHECKING:  # torch and the target code are imported by the functions that run, so `--help` stays fast
    import torch

    from eaglekit.target.capture import HiddenStateCapture
    from eaglekit.target.shard_writer import ShardWriter
    from eaglekit.target.store import StoreLayout

log = logging.getLogger(__name__)

POSITIONAL = ("data",)


@dataclass(frozen=True)
class Config:
    data: tuple[str, ...] = option((), "conversation files or directories (OpenAI messages, ShareGPT, prompt/completion)")
    output: str = option("", "output directory (shards, shard logs, manifest.json, config.yaml)")
    target: str = option("", "target model directory, hub id or 'tiny'")
    max_length: int = option(2048, "tokens per record; longer records are truncated (and counted)")
    aux_layer_ids: tuple[int, ...] = option((), "3 layer ids to capture (empty = 2, L//2, L-3)")
    # the choices spell out eaglekit.draft.model's conventions and eaglekit.target.store.STORAGE_DTYPES (tests/test_cli.py checks)
    aux_layer_convention: str = option("input_of_layer", "meaning of aux_layer_ids", choices=("input_of_layer", "output_of_layer"))
    dtype: str = option("bf16", "storage dtype; float8_e4m3fn halves the bytes (per-row scales)",
                        choices=("bf16", "fp16", "fp32", "float8_e4m3fn"))
    model_dtype: str = option("auto", "dtype the target runs in (auto = bf16 on GPU, fp32 on CPU)")
    device: str = option("auto", "device (auto, cpu, cuda, cuda:1); under torchrun each rank uses cuda:LOCAL_RANK")
    device_map: str = option("", "'auto' spreads one large target over all visible GPUs (not with torchrun)")
    batch_tokens: int = option(16384, "padded tokens per forward (batch size x longest record)")
    max_batch_size: int = option(64, "most records per forward")
    shard_mb: float = option(256.0, "approximate size of one shard file and host buffer in MiB (at least one batch)")
    buffers: int = option(0, "pinned host shard buffers in the writer ring (0 = auto: writer_threads + 2); "
                             "host memory = buffers x shard_mb")
    writer_threads: int = option(0, "threads hashing and writing shards in parallel (0 = auto: half the CPU cores "
                                    "per process, 2..8)")
    fsync: bool = option(True, "fsync each shard before logging it (off: faster on slow disks; a power loss may cost the last shards)")
    chat_template: str = option("", "chat template (Jinja text or file) instead of the tokenizer's own")
    decoder_path: str = option("", "dotted path of the decoder layer list, when the search picks the wrong one")
    limit: int = option(0, "extract only the first N records (0 = all)")
    skip_errors: bool = option(False, "skip malformed input records instead of stopping")
    overwrite: bool = option(False, "delete an existing store in output (else resume it)")
    trust_remote_code: bool = option(False, "allow the target's own modelling code")


@dataclass
class ExtractResult:
    output: Path
    stats: dict[str, Any] = field(default_factory=dict)


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
        if batches and len(batches[-1]) < max_batch_size and (len(batches[-1]) + 1) * len(batches[-1][0].input_ids) <= batch_tokens:
            batches[-1].append(record)
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


def resolve_aux_ids(config: Config, num_layers: int) -> tuple[int, ...]:
    """Requested ids in the input-of-layer convention (defaults when none given); checks the range."""
    from eaglekit.target.capture import default_aux_layers, to_input_convention

    if num_layers < 4:
        raise EaglekitError(f"target {config.target} has {num_layers} decoder layers; EAGLE-3 needs at least 4")
    if not config.aux_layer_ids:
        return default_aux_layers(num_layers)
    ids = to_input_convention(tuple(config.aux_layer_ids), config.aux_layer_convention)
    if len(ids) != 3 or not all(0 <= i <= num_layers for i in ids):
        raise EaglekitError(f"aux_layer_ids={list(config.aux_layer_ids)} ({config.aux_layer_convention}) must be 3 ids "
                            f"within the target's {num_layers} layers (input_of_layer 0..{num_layers}); omit them for the default")
    return ids


# ---- data ----------------------------------------------------------------------------------------

def tokenize_records(config: Config, tokenizer: Any) -> tuple[list[Record], dict[str, int]]:
    import torch

    from eaglekit.data import read_conversations, tokenize_conversation

    conversations = read_conversations(list(config.data), skip_errors=config.skip_errors)
    if config.limit:
        conversations = conversations[:config.limit]
    if not conversations:
        raise EaglekitError(f"no conversations in {', '.join(config.data)}; check the data files (empty?)")
    stats = {"records_read": len(conversations), "truncated": 0, "no_assistant_tokens": 0, "duplicates": 0}
    template = config.chat_template or None
    records: dict[str, Record] = {}
    for conversation in tqdm(conversations, desc="tokenise", unit="rec", leave=False):
        tokenized = tokenize_conversation(tokenizer, conversation, config.max_length, template)
        stats["truncated"] += int(tokenized.truncated)
        if tokenized.id in records:
            stats["duplicates"] += 1
        elif not any(tokenized.loss_mask):
            stats["no_assistant_tokens"] += 1
        else:
            records[tokenized.id] = Record(tokenized.id, torch.tensor(tokenized.input_ids, dtype=torch.long),
                                           torch.tensor(tokenized.loss_mask, dtype=torch.uint8))
    if stats["truncated"]:
        log.warning("%d of %d records were longer than max_length=%d and were truncated", stats["truncated"],
                    len(conversations), config.max_length)
    if not records:
        raise EaglekitError(f"none of the {len(conversations)} records has assistant tokens to learn from; check the data")
    return list(records.values()), stats


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


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _our_files(out: Path) -> list[Path]:
    from eaglekit.target.store import RUN_FILE

    names = ("shard-r*.safetensors", "shards-r*.jsonl", ".shard-r*.tmp", RUN_FILE, "manifest.json")
    return [p for pattern in names for p in out.glob(pattern)]


def prepare_output(out: Path, identity: dict[str, Any], overwrite: bool, rank: int, world: int) -> set[str]:
    """Guard resume against a different run, clean untrusted files; returns record ids already stored."""
    from eaglekit.target.store import RUN_FILE, merge_shard_logs, read_shard_log

    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if overwrite:
            for path in _our_files(out):
                path.unlink()
        previous = json.loads((out / RUN_FILE).read_text()) if (out / RUN_FILE).is_file() else None
        if previous is not None:
            changed = [k for k, v in identity.items() if previous.get(k) != v]
            if changed:
                raise EaglekitError(
                    f"{out} holds hidden states from a different run ({', '.join(f'{k}: {previous.get(k)} -> {identity[k]}' for k in changed)}); "
                    "pass --overwrite to replace them, or choose a new output directory")
        elif any(out.glob("shard-r*.safetensors")) or any(out.glob("shards-r*.jsonl")):
            raise EaglekitError(f"{out} holds shards without {RUN_FILE}; pass --overwrite or choose a new output directory")
        atomic_write_json(out / RUN_FILE, identity)
    _barrier(world)
    done = {record for entry in merge_shard_logs(out) for record in entry["records"]}
    logged = {entry["file"] for entry in read_shard_log(out, rank)}
    for path in list(out.glob(f"shard-r{rank:02d}-*.safetensors")) + list(out.glob(f".shard-r{rank:02d}-*.tmp")):
        if path.name not in logged:  # written but never logged (crash between rename and log): not trusted
            path.unlink()
    return done


def _layout_and_identity(config: Config, target_config: Any, tokenizer: Any, aux_ids: tuple[int, ...]) -> tuple[StoreLayout, dict[str, Any]]:
    from eaglekit.draft.model import INPUT_OF_LAYER
    from eaglekit.target.capture import text_config
    from eaglekit.target.store import STORE_FORMAT, StoreLayout

    text = text_config(target_config)
    layout = StoreLayout(hidden_size=text.hidden_size, num_aux=len(aux_ids), dtype=config.dtype)
    identity = {"format": STORE_FORMAT, "target_config_hash": target_config_hash(target_config),
                "tokenizer_hash": tokenizer_hash(tokenizer), "aux_layer_ids": list(aux_ids),
                "aux_layer_convention": INPUT_OF_LAYER, "dtype": config.dtype, "max_length": config.max_length,
                "chat_template": config.chat_template}
    return layout, identity


def _device(config: Config, world: int) -> torch.device:
    import torch

    from eaglekit.runtime import resolve_device

    if config.device_map and world > 1:
        raise EaglekitError("device_map=auto spreads ONE model over the GPUs; with torchrun use one GPU per rank (drop device_map)")
    device = resolve_device(config.device)
    if world > 1 and device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return device


# ---- the loop ------------------------------------------------------------------------------------

def batch_states(capture: HiddenStateCapture, index: torch.Tensor, layout: StoreLayout) -> dict[str, torch.Tensor]:
    """Captured (B, T, .) states -> padding-stripped (N, .) rows in the storage dtype, all on the device of
    the first aux state (one device even when device_map spreads the layers)."""
    from eaglekit.target.store import quantize_rows

    aux = capture.aux()  # (B, T, 3H)
    final = capture.final().to(aux.device)  # (B, T, H)
    index = index.to(aux.device, non_blocking=True)
    aux = aux.reshape(-1, aux.shape[-1]).index_select(0, index)  # (N, 3H)
    final = final.reshape(-1, final.shape[-1]).index_select(0, index)  # (N, H)
    if layout.quantized:
        aux_q, aux_scale = quantize_rows(aux, layout.num_aux)
        final_q, final_scale = quantize_rows(final, 1)
        return {"aux": aux_q, "final": final_q, "aux_scale": aux_scale, "final_scale": final_scale}
    return {"aux": aux.to(layout.torch_dtype), "final": final.to(layout.torch_dtype)}


def _input_device(model: torch.nn.Module) -> torch.device:
    return model.get_input_embeddings().weight.device


def extract_batches(model: torch.nn.Module, capture: HiddenStateCapture, batches: list[list[Record]],
                    writer: ShardWriter, layout: StoreLayout, pad_id: int, show: bool) -> int:
    """Forward every batch with the hooks on and hand its rows to the writer; returns tokens processed."""
    import torch

    from eaglekit.target.capture import forward_target
    from eaglekit.target.verify import check_hook_calls, check_shapes

    device = _input_device(model)
    pin = device.type == "cuda"
    hidden = layout.hidden_size
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
                check_shapes(capture, ids.shape[0], ids.shape[1], hidden)
                states = batch_states(capture, index, layout)
            capture.reset()  # drop references to the (B, T, H) activations before the next forward
            writer.add_batch([r.id for r in batch], [r.input_ids for r in batch], [r.loss_mask for r in batch], states)
            tokens += len(index)
            bar.update(len(index))
    return tokens


def _verify_first(model: torch.nn.Module, capture: HiddenStateCapture, batches: list[list[Record]]) -> dict[str, Any]:
    import torch

    from eaglekit.target.verify import verify_capture

    probe = batches[0][0].input_ids[:64][None] if batches else torch.arange(1, 9)[None]  # (1, T)
    return verify_capture(model, capture, probe.to(_input_device(model))).to_dict()


def _open_writer(config: Config, out: Path, layout: StoreLayout, rank: int, parallelism: tuple[int, int], pin: bool,
                 stats: dict[str, Any]) -> ShardWriter:
    """This rank's background shard writer (after its logged shards); records its size in `stats`."""
    from eaglekit.target.shard_writer import ShardWriter
    from eaglekit.target.store import read_shard_log

    threads, buffers = parallelism
    capacity = max(int(config.shard_mb * 2**20) // layout.bytes_per_token, config.batch_tokens)  # tokens: at least one batch
    start = max((e["index"] + 1 for e in read_shard_log(out, rank)), default=0)
    writer = ShardWriter(out, layout, capacity, rank=rank, start_index=start, num_buffers=buffers, pin_memory=pin,
                         metadata={"target": config.target, "dtype": config.dtype}, num_threads=threads, fsync=config.fsync)
    stats.update(writer_threads=threads, buffers=buffers, shard_tokens=capacity, host_buffer_GB=round(writer.host_bytes / 1e9, 3))
    log.info("rank %d: %d writer threads, %d shard buffers of %d tokens (%.2f GB of %s host memory)", rank, threads, buffers,
             capacity, writer.host_bytes / 1e9, "pinned" if pin else "pageable")
    return writer


def run(config: Config) -> ExtractResult:
    from eaglekit.runtime import resolve_dtype
    from eaglekit.target.capture import HiddenStateCapture, find_decoder, text_config
    from eaglekit.target.loading import load_target, load_target_config, load_tokenizer
    from eaglekit.target.shard_writer import writer_parallelism
    from eaglekit.target.store import split_for_rank

    if not config.output:
        raise EaglekitError("no output directory: pass output=DIR")
    if not config.data:
        raise EaglekitError("no data: pass conversation files, e.g. eaglekit extract data.jsonl output=DIR target=...")
    rank, world = distributed()
    parallelism = writer_parallelism(config.writer_threads, config.buffers)  # (threads, buffers); fails fast on bad values
    out = Path(config.output)
    target_config = load_target_config(config.target, config.trust_remote_code)  # fails fast: bad path, remote code
    tokenizer = load_tokenizer(config.target, trust_remote_code=config.trust_remote_code)
    records, stats = tokenize_records(config, tokenizer)
    num_layers = int(getattr(text_config(target_config), "num_hidden_layers", 0) or 0)
    aux_ids = resolve_aux_ids(config, num_layers)
    layout, identity = _layout_and_identity(config, target_config, tokenizer, aux_ids)
    done = prepare_output(out, identity, config.overwrite, rank, world)  # before loading a large model
    if rank == 0:
        save_resolved(config, out)
    device = _device(config, world)
    model = load_target(config.target, device=device, dtype=resolve_dtype(config.model_dtype, device),
                        trust_remote_code=config.trust_remote_code, device_map=config.device_map or None)
    stack = find_decoder(model, config.decoder_path or None)
    if stack.num_layers != num_layers:
        raise EaglekitError(f"the decoder found at {stack.path} has {stack.num_layers} layers but the config says "
                            f"{num_layers}; pass decoder_path= naming the text decoder's layer list")
    todo = [r for r in records if r.id not in done]
    if todo and rank == 0:  # new records: the store is not finished until this run writes a new manifest
        (out / "manifest.json").unlink(missing_ok=True)
    batches = split_for_rank(make_batches(todo, config.batch_tokens, config.max_batch_size), rank, world)
    log.info("rank %d/%d: %d records stored already, %d batches to extract", rank, world, len(done), len(batches))
    writer = _open_writer(config, out, layout, rank, parallelism, _input_device(model).type == "cuda", stats)
    begin = time.perf_counter()
    try:
        with HiddenStateCapture(model, aux_ids, decoder_path=stack.path) as capture:
            verification = _verify_first(model, capture, batches)
            tokens = extract_batches(model, capture, batches, writer, layout, tokenizer.pad_token_id or 0, rank == 0)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    seconds = time.perf_counter() - begin
    stats.update(tokens_extracted=tokens, seconds=round(seconds, 2), tokens_per_second=round(tokens / max(seconds, 1e-9), 1),
                 writer_wait_seconds=round(writer.wait_seconds, 2))
    _barrier(world)
    if rank == 0:
        _finish(out, config, model, stack.path, layout, identity, stats, verification, world)
    return ExtractResult(out, stats)


def _finish(out: Path, config: Config, model: torch.nn.Module, decoder_path: str, layout: StoreLayout,
            identity: dict[str, Any], stats: dict[str, Any], verification: dict[str, Any], world: int) -> None:
    from eaglekit.target.capture import text_config
    from eaglekit.target.store import merge_shard_logs

    shards = merge_shard_logs(out)
    num_tokens = sum(e["num_tokens"] for e in shards)
    text = text_config(model.config)
    data = {**identity, "target": config.target, "target_architecture": (getattr(model.config, "architectures", None) or [type(model).__name__])[0],
            "target_class": type(model).__name__, "decoder_path": decoder_path, "hidden_size": layout.hidden_size,
            "vocab_size": text.vocab_size, "num_layers": getattr(text, "num_hidden_layers", None),
            "storage": {"scale": "per token and layer (float32)" if layout.quantized else None, "bytes_per_token": layout.bytes_per_token},
            "shapes": {"input_ids": ["T"], "loss_mask": ["T"], "aux": ["T", layout.num_aux * layout.hidden_size], "final": ["T", layout.hidden_size]},
            "num_records": sum(len(e["records"]) for e in shards), "num_tokens": num_tokens,
            "bytes": sum(e["bytes"] for e in shards), "world_size": world, "data": list(config.data),
            "stats": stats, "verification": verification, "shards": shards}
    write_manifest(out, "extract", data)
    log.info("extract: %d records, %d tokens, %.2f GB in %d shards -> %s", data["num_records"], num_tokens,
             data["bytes"] / 1e9, len(shards), out)
