"""`eaglekit extract` end to end on a tiny random Llama: stored states equal an unpadded forward,
shards/manifest/reader, float8 storage, resume after a failed write, the writer's parallelism (auto
defaults; several threads write the same store as one), and every bad input."""

from __future__ import annotations

import errno
import json
import os
import random
import threading

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from eaglekit.config import load_config
from eaglekit.data import read_conversations, tokenize_conversation
from eaglekit.errors import EaglekitError
from eaglekit.manifest import file_sha256
from eaglekit.stages import extract
from eaglekit.targets import shard_writer
from eaglekit.targets.capture import HiddenStateCapture, forward_target
from eaglekit.targets.identity import target_config_hash, tokenizer_hash
from eaglekit.targets.inspection import format_target_report, target_report
from eaglekit.targets.loading import load_target
from eaglekit.targets.store import HiddenStateDataset, dequantize_rows, quantize_rows
from test_data_support import build_chat_tokenizer, template_text

LAYERS, HIDDEN = 6, 32
WORDS = "the a cat dog sat on mat code python def return list dict value key error file read write".split()


def _save_target(directory, layers: int = LAYERS):
    tokenizer = build_chat_tokenizer(template_text("llama3"))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return _save_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    with open(path, "w") as handle:
        for i in range(14):
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))
            answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 16)))
            handle.write(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": question},
                                                                 {"role": "assistant", "content": answer}]}) + "\n")
    return path


def run_extract(target_dir, data_file, out, **overrides):
    options = {"data": [str(data_file)], "output": str(out), "target": str(target_dir), "dtype": "fp32",
               "batch_tokens": 512, "max_batch_size": 4, "shard_mb": 0.1, "max_length": 256, **overrides}
    return extract.run(load_config(extract.Config, overrides=options))


@pytest.fixture(scope="module")
def fp32_store(target_dir, data_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("store")
    return out, run_extract(target_dir, data_file, out)


def test_stored_states_equal_an_unpadded_forward(target_dir, data_file, fp32_store):
    out, result = fp32_store
    dataset = HiddenStateDataset(out)
    manifest = dataset.manifest
    assert len(manifest["shards"]) > 1 and manifest["num_records"] == len(dataset) == 14
    assert manifest["aux_layer_ids"] == [1, 3, 5] and manifest["aux_layer_convention"] == "input_of_layer"
    assert manifest["verification"]["ok"] and manifest["verification"]["hook_calls"] == {"aux1": 1, "aux3": 1, "aux5": 1, "final": 1}
    model, tokenizer = load_target(str(target_dir)), AutoTokenizer.from_pretrained(target_dir)
    conversations = {c.id: c for c in read_conversations([data_file])}
    assert sorted(dataset.ids) == sorted(conversations)
    assert manifest["num_tokens"] == sum(len(dataset[i]["input_ids"]) for i in range(len(dataset)))
    with HiddenStateCapture(model, (1, 3, 5)) as capture, torch.inference_mode():
        for i in (0, 5, 13):
            record = dataset[i]
            tokenized = tokenize_conversation(tokenizer, conversations[record["id"]], 256)
            assert record["input_ids"].tolist() == tokenized.input_ids
            assert record["loss_mask"].tolist() == [bool(m) for m in tokenized.loss_mask]
            forward_target(model, record["input_ids"][None])
            assert record["aux"].shape == (len(tokenized.input_ids), 3 * HIDDEN)
            torch.testing.assert_close(record["aux"], capture.aux()[0], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(record["final"], capture.final()[0], atol=2e-5, rtol=1e-4)
    assert result.stats["truncated"] == 0 and result.stats["records_read"] == 14


def test_float8_halves_bytes_with_bounded_error(target_dir, data_file, fp32_store, tmp_path):
    reference = HiddenStateDataset(fp32_store[0])
    stores = {dtype: HiddenStateDataset(run_extract(target_dir, data_file, tmp_path / dtype, dtype=dtype).output)
              for dtype in ("bf16", "float8_e4m3fn")}
    bf16, fp8 = stores["bf16"].manifest["bytes"], stores["float8_e4m3fn"].manifest["bytes"]
    assert 0.45 < fp8 / bf16 < 0.6  # scales (3 + 1 float32 per token) cost extra at H=32; ~0.51 at H=4096
    by_id = {reference[i]["id"]: reference[i] for i in range(len(reference))}
    for dtype, bound in (("bf16", 0.01), ("float8_e4m3fn", 0.05)):
        store = stores[dtype]
        errors = [((store[i]["aux"].float() - by_id[store[i]["id"]]["aux"]).norm() / by_id[store[i]["id"]]["aux"].norm()).item()
                  for i in range(len(store))]
        assert max(errors) < bound, (dtype, max(errors))


def test_quantize_rows_round_trip():
    x = torch.randn(7, 3 * 64) * torch.tensor([1.0, 30.0, 0.01]).repeat_interleave(64)  # layers of very different scale
    q, scale = quantize_rows(x, 3)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (7, 3)
    back = dequantize_rows(q, scale, torch.float32)
    for g in range(3):  # per-layer scales keep the small layer's relative error small too
        part = slice(g * 64, (g + 1) * 64)
        assert ((back[:, part] - x[:, part]).norm() / x[:, part].norm()) < 0.05


def test_disk_full_keeps_earlier_shards_and_resume_completes(target_dir, data_file, fp32_store, tmp_path, monkeypatch):
    real = shard_writer.write_safetensors

    def failing(handle, tensors, metadata):  # the disk fills while shard 1 is written (whichever writer thread has it)
        if "shard-r00-00001" in handle.handle.name:
            handle.write(b"partial bytes")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(handle, tensors, metadata)

    monkeypatch.setattr(shard_writer, "write_safetensors", failing)
    with pytest.raises(EaglekitError, match="No space left.*intact.*re-run"):
        run_extract(target_dir, data_file, tmp_path)
    assert not (tmp_path / "manifest.json").exists()
    logged = [json.loads(line) for line in (tmp_path / "shards-r00.jsonl").read_text().splitlines()]
    assert not list(tmp_path.glob(".*tmp")) and "shard-r00-00001.safetensors" not in {e["file"] for e in logged}
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == sorted(e["file"] for e in logged)  # only complete, logged shards
    assert all(file_sha256(tmp_path / e["file"]) == e["sha256"] for e in logged)
    first = logged[0]
    monkeypatch.setattr(shard_writer, "write_safetensors", real)
    run_extract(target_dir, data_file, tmp_path)
    resumed, fresh = HiddenStateDataset(tmp_path), HiddenStateDataset(fp32_store[0])
    assert resumed.manifest["shards"][0]["sha256"] == first["sha256"]  # the first shard was kept, not redone
    assert sorted(resumed.ids) == sorted(fresh.ids)
    fresh_by_id = {fresh[i]["id"]: fresh[i] for i in range(len(fresh))}
    for i in range(len(resumed)):
        assert torch.equal(resumed[i]["aux"], fresh_by_id[resumed[i]["id"]]["aux"])


def test_writer_parallelism_auto_and_explicit(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    threads, buffers = shard_writer.writer_parallelism()  # this machine's auto values
    assert threads >= 2 and buffers > threads
    for cores, expected in ((1, (2, 4)), (6, (3, 5)), (16, (8, 10)), (128, (8, 10))):  # half the cores, 2..8; + 2
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)), raising=False)
        assert shard_writer.writer_parallelism() == expected
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")  # torchrun ranks share the machine's 128 cores
    assert shard_writer.writer_parallelism() == (2, 4)
    assert shard_writer.writer_parallelism(3, 7) == (3, 7) and shard_writer.writer_parallelism(5, 0) == (5, 7)
    assert shard_writer.writer_parallelism(0, 1) == (1, 1)  # no more threads than buffers to write
    with pytest.raises(EaglekitError, match="writer_threads=-1.*0 = automatic"):
        shard_writer.writer_parallelism(-1, 0)


def test_large_blocks_are_hashed_while_written(tmp_path):
    from safetensors import safe_open

    tensors = {"ids": torch.arange(5, dtype=torch.int32), "aux": torch.randn(4096, 384)}  # aux: 6 MiB, hashed on the helper
    assert tensors["aux"].nbytes > shard_writer._OVERLAP_BYTES
    size, digest = shard_writer.write_bytes_atomically(tmp_path, "s.safetensors", tensors, {"format": "eaglekit"})
    assert size == (tmp_path / "s.safetensors").stat().st_size and digest == file_sha256(tmp_path / "s.safetensors")
    with safe_open(str(tmp_path / "s.safetensors"), "pt") as handle:
        assert all(torch.equal(handle.get_tensor(name), tensor) for name, tensor in tensors.items())


def test_several_writer_threads_write_the_store_of_one(target_dir, data_file, tmp_path, monkeypatch):
    serial = HiddenStateDataset(run_extract(target_dir, data_file, tmp_path / "one", writer_threads=1, buffers=1).output)
    real, second_started = shard_writer.write_safetensors, threading.Event()
    waited = []

    def overlapping(handle, tensors, metadata):  # shard 0 is written only once shard 1's write has begun
        if "shard-r00-00001" in handle.handle.name:
            second_started.set()
        if "shard-r00-00000" in handle.handle.name:
            waited.append(second_started.wait(timeout=60))
        return real(handle, tensors, metadata)

    monkeypatch.setattr(shard_writer, "write_safetensors", overlapping)
    result = run_extract(target_dir, data_file, tmp_path / "four", writer_threads=4, buffers=6)
    parallel = HiddenStateDataset(result.output)
    assert waited == [True] and result.stats["writer_threads"] == 4 and result.stats["buffers"] == 6
    assert serial.manifest["stats"]["writer_threads"] == 1 and len(serial.manifest["shards"]) > 2
    assert parallel.manifest["shards"] == serial.manifest["shards"]  # same files, records, order and sha256
    assert all(file_sha256(result.output / e["file"]) == e["sha256"] for e in parallel.manifest["shards"])
    assert parallel.ids == serial.ids
    for i in range(len(parallel)):
        assert torch.equal(parallel[i]["aux"], serial[i]["aux"]) and torch.equal(parallel[i]["final"], serial[i]["final"])


def test_resume_refuses_another_config_and_overwrite_replaces(target_dir, data_file, tmp_path):
    run_extract(target_dir, data_file, tmp_path, limit=3)
    with pytest.raises(EaglekitError, match="different run.*aux_layer_ids.*--overwrite"):
        run_extract(target_dir, data_file, tmp_path, aux_layer_ids=[1, 2, 4])
    result = run_extract(target_dir, data_file, tmp_path, aux_layer_ids=[0, 1, 2], aux_layer_convention="output_of_layer",
                         overwrite=True, limit=3)
    assert HiddenStateDataset(result.output).manifest["aux_layer_ids"] == [1, 2, 3]


def test_reader_validates_identity_and_checksums(target_dir, data_file, tmp_path):
    out = run_extract(target_dir, data_file, tmp_path, limit=4).output
    dataset = HiddenStateDataset(out)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    dataset.validate(hidden_size=HIDDEN, aux_layer_ids=(1, 3, 5), tokenizer_hash=tokenizer_hash(tokenizer),
                     target_config_hash=target_config_hash(AutoConfig.from_pretrained(target_dir)))
    dataset.validate(aux_layer_ids=(0, 2, 4), aux_layer_convention="output_of_layer")
    with pytest.raises(EaglekitError, match="hidden_size=32.*uses 64"):
        dataset.validate(hidden_size=64)
    with pytest.raises(EaglekitError, match="aux_layer_ids"):
        dataset.validate(aux_layer_ids=(2, 3, 4))
    shard = out / dataset.manifest["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(EaglekitError, match="corrupt"):
        HiddenStateDataset(out)[0]
    with pytest.raises(EaglekitError, match="no manifest.json"):
        HiddenStateDataset(tmp_path / "nothing")


def test_truncation_is_counted(target_dir, data_file, tmp_path):
    result = run_extract(target_dir, data_file, tmp_path, max_length=90)
    assert result.stats["truncated"] > 0
    dataset = HiddenStateDataset(result.output)
    assert max(len(dataset[i]["input_ids"]) for i in range(len(dataset))) == 90
    assert dataset.manifest["stats"]["truncated"] == result.stats["truncated"]


@pytest.mark.parametrize("case, message", [
    ("unknown_path", "no-such-model does not exist"),
    ("two_layers", "2 decoder layers has too few"),
    ("ids_out_of_range", "aux_layer_ids=.*within the target's 6 layers"),
    ("empty_data", "no records found|no conversations"),
    ("remote_code", "trust_remote_code"),
])
def test_bad_input(case, message, target_dir, data_file, tmp_path):
    target, data, extra = target_dir, data_file, {}
    if case == "unknown_path":
        target = tmp_path / "no-such-model"
    elif case == "two_layers":
        target = _save_target(tmp_path / "small", layers=2)
    elif case == "ids_out_of_range":
        extra = {"aux_layer_ids": [2, 3, 7]}
    elif case == "empty_data":
        data = tmp_path / "empty.jsonl"
        data.write_text("")
    elif case == "remote_code":
        target = tmp_path / "remote"
        target.mkdir()
        (target / "config.json").write_text(json.dumps({"model_type": "custom_thing", "auto_map": {"AutoConfig": "x.CustomConfig"}}))
        (target / "tokenizer_config.json").write_text("{}")
    assert extract.Config().trust_remote_code is False
    with pytest.raises(EaglekitError, match=message):
        run_extract(target, data, tmp_path / "out", **extra)


def test_identity_hashes(target_dir, tmp_path):
    model = load_target(str(target_dir))
    assert target_config_hash(model.config) == target_config_hash(AutoConfig.from_pretrained(target_dir))
    other = LlamaConfig.from_pretrained(target_dir)
    other.num_hidden_layers = 5
    assert target_config_hash(other) != target_config_hash(model.config)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    tokenizer.save_pretrained(tmp_path)
    assert tokenizer_hash(AutoTokenizer.from_pretrained(tmp_path)) == tokenizer_hash(tokenizer)
    tokenizer.chat_template = "{{ messages }}"
    assert tokenizer_hash(tokenizer) != tokenizer_hash(AutoTokenizer.from_pretrained(tmp_path))


def test_target_report(target_dir):
    report = target_report(str(target_dir))
    assert report["class"] == "LlamaForCausalLM" and report["decoder_path"] == "model.layers"
    assert report["num_layers"] == LAYERS and report["hidden_size"] == HIDDEN and report["default_aux_layer_ids"] == [1, 3, 5]
    assert report["verification"]["ok"] and "transformers.models.llama.modeling_llama.LlamaForCausalLM" in report["mro"]
    text = format_target_report(report)
    assert "loaded class:     LlamaForCausalLM" in text and "verification:     OK" in text and "model.layers" in text


def test_split_and_merge_across_ranks(tmp_path):
    from eaglekit.targets.store import fsync_append, log_name, merge_shard_logs, split_for_rank

    batches = list(range(11))
    shares = [split_for_rank(batches, rank, 3) for rank in range(3)]
    assert sorted(sum(shares, [])) == batches and [len(s) for s in shares] == [4, 4, 3]
    for rank, records in ((1, ["c", "d"]), (0, ["a", "b"])):
        name = f"shard-r{rank:02d}-00000.safetensors"
        (tmp_path / name).write_bytes(b"x" * 5)
        fsync_append(tmp_path / log_name(rank), json.dumps({"file": name, "rank": rank, "index": 0, "records": records,
                                                            "num_tokens": 2, "bytes": 5, "sha256": "0"}))
    (tmp_path / log_name(1)).open("a").write('{"torn": ')  # a crash mid-line: ignored
    assert [e["records"] for e in merge_shard_logs(tmp_path)] == [["a", "b"], ["c", "d"]]
    fsync_append(tmp_path / log_name(2), json.dumps({"file": "shard-r00-00000.safetensors", "rank": 2, "index": 0,
                                                     "records": ["a"], "num_tokens": 1, "bytes": 5, "sha256": "0"}))
    with pytest.raises(EaglekitError, match="record a is in both"):
        merge_shard_logs(tmp_path)


def test_torchrun_two_ranks_gloo(target_dir, data_file, fp32_store, tmp_path):
    """Two CPU processes under torchrun (gloo): each rank writes its own shards, rank 0 one merged manifest."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(port), "-m", "eaglekit", "extract", str(data_file), f"output={tmp_path}",
               f"target={target_dir}", "dtype=fp32", "device=cpu", "batch_tokens=512", "max_batch_size=4", "shard_mb=0.1",
               "max_length=256"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    dataset, reference = HiddenStateDataset(tmp_path), HiddenStateDataset(fp32_store[0])
    assert dataset.manifest["world_size"] == 2 and {s["rank"] for s in dataset.manifest["shards"]} == {0, 1}
    assert sorted(dataset.ids) == sorted(reference.ids)
    by_id = {reference[i]["id"]: reference[i] for i in range(len(reference))}
    for i in range(len(dataset)):
        torch.testing.assert_close(dataset[i]["aux"], by_id[dataset[i]["id"]]["aux"], atol=2e-5, rtol=1e-4)


def test_reader_checks_each_shard_once_and_pickles(fp32_store, monkeypatch):
    import pickle

    from eaglekit.targets import store

    dataset = HiddenStateDataset(fp32_store[0])
    hashed = []
    monkeypatch.setattr(store, "file_sha256", lambda path: hashed.append(path) or file_sha256(path))
    order = list(range(len(dataset))) * 2
    random.Random(0).shuffle(order)
    first = {i: dataset[i]["aux"] for i in order}
    assert len(hashed) == len(dataset.manifest["shards"])  # shuffled reads do not re-hash a shard
    copy = pickle.loads(pickle.dumps(dataset))
    assert all(torch.equal(copy[i]["aux"], first[i]) for i in range(len(copy)))
