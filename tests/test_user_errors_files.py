"""What a new user hits on disk and in training: bad input through the CLI gives exit 1, ONE error line naming
the fix, no traceback, and leaves every file already on disk as it was (docs/errors.md lists each case).

A CLI subprocess costs seconds of imports (far more on a loaded machine), so only what needs a real process runs as
`python -m eaglekit` (a mistyped target, the progress bar on a terminal); the other cases call `eaglekit.cli.main`
in-process (the same code path: parsing, the stage, the error line, the log lines).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eaglekit.errors import EaglekitError

from user_errors import CHAT, assert_unchanged, in_process, one_error, run_main, snapshot, write_jsonl

# ---- 5. filesystem errors ------------------------------------------------------------------------

def test_an_output_path_that_is_a_file(chat_target, drafter_dir, data, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("not a folder")
    before = snapshot(tmp_path)
    code, stderr = run_main("vocab", str(data), f"target={chat_target}", f"output={taken}", cwd=tmp_path)
    assert code == 1
    one_error(stderr, f"output {taken} is a file", "directory")
    for args in (("export", str(drafter_dir), f"output={taken}"),
                 ("regen", str(data), f"target={chat_target}", f"output={taken}"),
                 ("extract", str(data), f"target={chat_target}", f"output={taken}"),
                 ("train", f"target={chat_target}", f"data={data}", f"output={taken}"),
                 ("generate", "hi", f"target={chat_target}", "method=plain", f"output={tmp_path}")):
        assert "output" in in_process(capsys, *args)
    assert_unchanged(before, tmp_path)


def test_a_damaged_safetensors_header(drafter_dir, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_bytes((drafter_dir / "config.json").read_bytes())
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}xxxxxx")
    before = snapshot(tmp_path)
    line = in_process(capsys, "export", str(broken), f"output={tmp_path / 'out'}")
    assert "model.safetensors is damaged" in line and "re-run the stage that wrote it" in line
    assert_unchanged(before, tmp_path)


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_in_train_leaves_no_partial_checkpoint(chat_target, data, tmp_path, monkeypatch):
    from eaglekit.config import load_config
    from eaglekit.training import checkpoint
    from eaglekit.stages import train

    monkeypatch.setattr(checkpoint.torch, "save", _disk_full)
    config = load_config(train.Config, overrides={"target": chat_target, "data": [str(data)], "max_steps": 1,
                                                  "output": str(tmp_path / "t"), "save_every": 1, "batch_size": 2,
                                                  "ttt_steps": 1, "draft_vocab_size": 64, "max_length": 64})
    with pytest.raises(EaglekitError, match="disk full while writing the training checkpoints"):
        train.run(config)
    assert not list((tmp_path / "t" / "checkpoints").glob(".tmp-step-*"))


def test_a_full_disk_in_regen_keeps_finished_records(chat_target, tmp_path, monkeypatch):
    from eaglekit.config import load_config
    from eaglekit.stages import regen
    from eaglekit.generation import regen as library

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"p{i}", "messages": CHAT} for i in range(2)])
    config = load_config(regen.Config, overrides={"data": [str(prompts)], "target": chat_target, "max_new_tokens": 2,
                                                  "output": str(tmp_path / "r"), "limit": 1})
    regen.run(config)
    before = snapshot(tmp_path)
    monkeypatch.setattr(library.JsonlAppender, "write", _disk_full)
    with pytest.raises(EaglekitError, match="disk full while writing the regenerated records.*re-run the same command"):
        regen.run(dataclasses.replace(config, limit=2))
    assert_unchanged({k: v for k, v in before.items() if k.endswith("conversations.jsonl")}, tmp_path)


# ---- 6 and 8. training progress, max_steps over epochs, one name for aux layers ----------------------

def test_train_logs_progress_and_max_steps_wins_over_epochs(chat_target, data, tmp_path, capsys):
    code, stderr = run_main("train", f"target={chat_target}", f"data={data}", "output=t", "max_steps=7", "epochs=1",
                       "batch_size=4", "val_fraction=0.2", "log_every=2", "ttt_steps=1", "draft_vocab_size=64",
                       "max_length=64", "resume=true", cwd=tmp_path)
    assert code == 0, stderr
    assert "max_steps=7 decides (epochs=1 is ignored)" in stderr
    assert "the validation split holds 2 record(s) (val_fraction=0.2 of 12)" in stderr  # figures of 2 records: noise
    assert "resume=true but" not in stderr  # a fresh run has nothing to resume: nothing to say
    assert "step 2/7 (epoch 1, " in stderr and "acc@1" in stderr and "tokens/s, ETA" in stderr
    assert json.loads((tmp_path / "t" / "manifest.json").read_text())["steps"] == 7
    line = in_process(capsys, "train", f"target={chat_target}", f"data={data}", "output=x", "aux_layers=1,2,3")
    assert "'aux_layers' is now called 'aux_layer_ids'" in line


def test_train_draws_a_progress_bar_on_a_terminal(chat_target, data, tmp_path):
    """On a terminal (a pseudo-terminal here) train shows one tqdm bar with loss and acc@1 instead of log lines."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # 40 x 160: tqdm sizes its bar
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "eaglekit", "train", f"target={chat_target}", f"data={data}",
                             "output=t", "max_steps=6", "batch_size=4", "val_fraction=0.2", "log_every=2",
                             "ttt_steps=1", "draft_vocab_size=64", "max_length=64"],
                            cwd=tmp_path, env=env, stdin=follower, stdout=follower, stderr=follower)
    os.close(follower)
    chunks = []
    try:
        while select.select([leader], [], [], 300)[0]:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the child closed its end
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(leader)
        proc.wait(timeout=60)
    screen = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, screen[-2000:]
    assert "train: 100%" in screen and "6/6" in screen and "loss=" in screen and "acc@1=" in screen, screen[-2000:]
    assert "\r" in screen.replace("\r\n", "")  # redrawn in place
    assert "step 2/6 (epoch" not in screen  # the bar stands in for the log lines a file gets


def test_train_without_assistant_tokens(chat_target, tmp_path, capsys):
    questions = write_jsonl(tmp_path / "q.jsonl", [{"id": f"q{i}", "messages": CHAT[:1]} for i in range(4)])
    line = in_process(capsys, "train", f"target={chat_target}", f"data={questions}", f"output={tmp_path / 't'}")
    assert "no assistant tokens in DATA" in line and "eaglekit inspect" in line


def test_small_targets_get_distinct_aux_layers_and_three_layers_extract(tmp_path, data, caplog, capsys, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import build_chat_target
    from eaglekit import layers
    from eaglekit.config import load_config
    from eaglekit.stages import extract
    from eaglekit.targets.capture import default_aux_layers

    monkeypatch.setattr(layers, "_warned_small", set())  # warned once per process: an earlier test may have seen 5 layers
    with caplog.at_level(logging.WARNING):
        assert default_aux_layers(5) == (1, 2, 4)
    assert "repeat a layer" in caplog.text
    target = Path(build_chat_target(tmp_path / "three"))
    config = json.loads((target / "config.json").read_text())
    LlamaForCausalLM(LlamaConfig(**{**config, "num_hidden_layers": 3})).save_pretrained(target)
    overrides = {"data": [str(data)], "target": str(target), "limit": 2, "output": str(tmp_path / "x"),
                 "aux_layer_ids": [0, 2, 3]}
    result = extract.run(load_config(extract.Config, overrides=overrides))
    assert json.loads((result.output / "manifest.json").read_text())["aux_layer_ids"] == [0, 2, 3]
    # 5. a shard whose safetensors header is damaged (the checksum is checked later): one error naming it
    shard = next(result.output.glob("shard-*.safetensors"))
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}" + shard.read_bytes()[18:])
    before = snapshot(tmp_path)
    line = in_process(capsys, "vocab", f"shards={result.output}", f"output={tmp_path / 'v'}")
    assert f"shard {shard} cannot be read" in line and "re-run extract" in line
    assert_unchanged(before, tmp_path)


def test_regen_and_serve_take_a_chat_template(chat_target, tmp_path):
    from eaglekit.generation.backends import HFBackend

    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    backend = HFBackend.load(chat_target, "cpu", "fp32", chat_template=template)
    assert backend.decode(backend.encode_chat([CHAT[0]])).startswith("[user] what is two plus two")


def test_serve_passes_the_drafters_tree_and_chain_shape(chat_target, drafter_dir):
    from eaglekit.stages import serve

    tree = serve.build_engine(serve.Config(target=chat_target, drafter=str(drafter_dir), depth=3, total_tokens=10,
                                           tree_top_k=2))
    chain = serve.build_engine(serve.Config(target=chat_target, drafter=str(drafter_dir), method="chain",
                                            chain_length=2))
    assert tree.options == {"depth": 3, "total_tokens": 10, "tree_top_k": 2} and chain.options == {"chain_length": 2}
    assert tree.max_context < 512  # the context keeps room for one step's drafts


# ---- 7. the report explains its numbers -------------------------------------------------------------

def test_report_explains_its_numbers_and_flags_a_drafter_that_learned_nothing(tmp_path):
    from eaglekit.report import write_report

    out = tmp_path / "run"
    (out / "train").mkdir(parents=True)
    (out / "bench").mkdir()
    drafter = {"hidden_size": 128, "intermediate_size": 384, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 32, "draft_vocab_size": 2048, "target_hidden_size": 128}
    val = {"loss": 11.86, "loss_k": [4.86, 4.50, 4.20], "acc_k": [0.0, 0.0, 0.0], "tau": 1.0, "step": 9}
    (out / "run.json").write_text(json.dumps({"config": {"target": "tiny"}, "steps": []}))
    (out / "train" / "manifest.json").write_text(json.dumps({"stage": "train", "val": val, "drafter_config": drafter,
                                                             "config": {"step_decay": 0.8}}))
    rows = [{"method": "plain", "temperature": 0.0, "tokens_per_second": 100.0},
            {"method": "tree", "temperature": 0.0, "tokens_per_second": 84.0, "tau": 1.14,
             "acceptance_per_position": [0.1]}]
    (out / "bench" / "bench.json").write_text(json.dumps({"rows": rows, "config": {"device": "cpu", "depth": 3}}))
    (out / "bench" / "manifest.json").write_text(json.dumps({"stage": "bench"}))
    text = write_report(out).path.read_text()
    assert "tau = tokens produced per target forward" in text
    assert "0.84x is no verdict on the drafter" in text and "1 + 3 x 26% = 1.8 target steps" in text
    assert "tau / speed-up = 1.14 / 0.84 = 1.4 plain steps per verification" in text
    assert "sum over the 3 draft positions of 0.8^k" in text
    assert "this drafter learned (next to) nothing" in text
    assert "validation accuracy at draft position 1 is 0.000" in text
    val["acc_k"] = [0.962, 0.962, 0.952]  # right on its data, nothing accepted: not a matter of training longer
    (out / "train" / "manifest.json").write_text(json.dumps({"stage": "train", "val": val, "drafter_config": drafter,
                                                             "config": {"step_decay": 0.8}}))
    text = write_report(out).path.read_text()
    assert "right in validation but not when decoding" in text and "Training longer will not help" in text
    assert "learned (next to) nothing" not in text


def test_train_warns_when_no_position_has_a_loss(chat_target, data, tmp_path, caplog):
    from eaglekit.config import load_config
    from eaglekit.stages import train

    overrides = {"target": chat_target, "data": [str(data)], "output": str(tmp_path / "t"), "max_steps": 1,
                 "batch_size": 4, "ttt_steps": 1, "draft_vocab_size": 1, "max_length": 64}
    with caplog.at_level(logging.WARNING):
        train.run(load_config(train.Config, overrides=overrides))
    assert "has no loss to learn from" in caplog.text and "raise draft_vocab_size" in caplog.text


def test_run_refuses_what_bench_or_export_would_refuse_before_training(tmp_path, capsys):
    """A target whose layers speculative decoding cannot run (Llama-4's chunked attention), or aux layers an export
    format cannot address: `run` says so before the first stage, in one line, and writes nothing."""
    import transformers

    target = tmp_path / "llama4"
    transformers.Llama4TextConfig(vocab_size=96, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  attention_chunk_size=4, num_local_experts=2).save_pretrained(target)
    before = snapshot(tmp_path)
    line = in_process(capsys, "run", "--target", str(target), "--data", "tiny", "--out", str(tmp_path / "run"))
    assert "bench would refuse this run after training, so nothing ran:" in line
    assert "has chunked_attention layers" in line and "(bench: methods=plain,hf,hf_prompt_lookup)" in line
    line = in_process(capsys, "run", "--target", "tiny", "--data", "tiny", "--out", str(tmp_path / "run"),
                      "train.aux_layer_ids=0,2,3")
    assert "export would refuse this run after training" in line and "export --to sglang: aux layer ids" in line
    assert_unchanged(before, tmp_path)
    assert not (tmp_path / "run").exists()


def test_the_automatic_backend_choice_gives_no_advice_to_follow(caplog):
    import transformers

    from eaglekit.decode.setup import resolve_backend

    config = transformers.GraniteConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2)
    with caplog.at_level(logging.INFO, logger="eaglekit"):
        assert resolve_backend("auto", transformers.GraniteForCausalLM(config)) == "eager"
    assert "not 'granite'); using the eager backend" in caplog.text and "use backend=eager" not in caplog.text
