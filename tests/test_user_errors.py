"""What a new user hits: bad input through the CLI gives exit 1, ONE error line naming the fix, no traceback,
and leaves every file already on disk as it was (docs/errors.md lists each case).

A CLI subprocess costs seconds of imports (far more on a loaded machine), so only what needs a real process runs as
`python -m eaglekit` (a mistyped target, the progress bar on a terminal); the other cases call `eaglekit.cli.main`
in-process (the same code path: parsing, the stage, the error line, the log lines).
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from eaglekit.cli import main
from eaglekit.drafters.dspark.model import DSparkConfig, DSparkDrafter
from eaglekit.errors import EaglekitError
from eaglekit.manifest import claim_output

from user_errors import (CHAT, assert_unchanged, cli, in_process, one_error, run_main, save_drafter, snapshot,
                         write_jsonl)

# ---- 1. defaults that fail -----------------------------------------------------------------------

def test_regen_caps_answers_and_advises_a_retry_only_when_one_can_succeed(chat_target, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_target)

    def prompt_tokens(text: str) -> int:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        return len(tokenizer(rendered, add_special_tokens=False)["input_ids"])

    words = ["the quick brown fox"]
    while prompt_tokens(" ".join(words)) < 500:  # leaves the answer a few of the 512-token context's positions
        words.append("the quick brown fox")
    fits, too_long = " ".join(words), " ".join(words * 2)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": name, "messages": [{"role": "user", "content": text}]}
                                                       for name, text in (("short", fits), ("long", too_long))])
    before = snapshot(tmp_path)
    code, stderr = run_main("regen", str(prompts), f"target={chat_target}", "output=out", "max_new_tokens=1024",
                       cwd=tmp_path)
    assert code == 1
    line = one_error(stderr, "1 record(s) failed", "fills the target's context", "shorten or drop")
    assert "re-run the same command" not in line  # it would fail the same way
    assert "1 answer(s) were cut to the context their prompt leaves" in stderr  # the short one was answered
    lines = (tmp_path / "out" / "conversations.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == ["short"]
    assert_unchanged(before, tmp_path)


def test_serve_caps_a_default_max_tokens_at_the_context_left(chat_target):
    from eaglekit.stages import serve
    from eaglekit.generation.backends import HFBackend

    backend = HFBackend.load(chat_target, "cpu", "fp32")
    prompt = backend.encode_chat([CHAT[0]])
    backend.max_context = len(prompt) + 3
    config = serve.Config(target=chat_target, port=0, max_tokens=64)
    with serve.build_server(config, engine=backend) as running, httpx.Client(timeout=60) as client:
        url = running.url + "/v1/chat/completions"
        default = client.post(url, json={"messages": [CHAT[0]], "temperature": 0})
        explicit = client.post(url, json={"messages": [CHAT[0]], "temperature": 0, "max_tokens": 64})
    assert default.status_code == 200 and default.json()["usage"]["completion_tokens"] <= 3
    assert explicit.status_code == 400 and explicit.json()["error"]["code"] == "context_length_exceeded"


# ---- 2. silent overwrites ------------------------------------------------------------------------

def test_export_refuses_a_trained_drafters_folder(drafter_dir, tmp_path):
    trained = tmp_path / "trained"
    trained.mkdir()
    (trained / "model.safetensors").write_bytes(b"trained weights")
    (trained / "manifest.json").write_text(json.dumps({"stage": "train"}))
    before = snapshot(tmp_path)
    code, stderr = run_main("export", str(drafter_dir), "--to", "vllm", f"output={trained}", cwd=tmp_path)
    assert code == 1
    one_error(stderr, "was written by `eaglekit train`", "overwrite=true")
    assert_unchanged(before, tmp_path)


def test_a_mistyped_drafter_to_export_or_import_is_named_with_its_sibling(tmp_path):
    (tmp_path / "train").mkdir()
    for stage in ("export", "import"):
        code, stderr = run_main(stage, str(tmp_path / "trian"), "--to", "vllm", f"output={tmp_path / 'out'}",
                                cwd=tmp_path) if stage == "export" else run_main(
            stage, str(tmp_path / "trian"), f"output={tmp_path / 'out'}", cwd=tmp_path)
        assert code == 1
        one_error(stderr, f"{tmp_path / 'trian'} does not exist (did you mean {tmp_path / 'train'}?)")
    assert not (tmp_path / "out").exists()


def test_a_mistyped_drafter_is_refused_before_the_target_loads(tmp_path, monkeypatch):
    import eaglekit.targets.loading
    from eaglekit.config import load_config
    from eaglekit.stages import serve

    def no_loading(*args, **kwargs):
        raise AssertionError("the target was loaded before the drafter path was checked")

    monkeypatch.setattr(eaglekit.targets.loading, "load_target", no_loading)
    (tmp_path / "train").mkdir()
    missing = f"{tmp_path / 'trian'} does not exist (did you mean {tmp_path / 'train'}?)"
    for args in (("generate", "x = 1", "target=tiny", f"drafter={tmp_path / 'trian'}"),
                 ("bench", "tiny-eval", "target=tiny", f"drafter={tmp_path / 'trian'}", f"output={tmp_path / 'b'}")):
        code, stderr = run_main(*args, cwd=tmp_path)
        assert code == 1
        one_error(stderr, missing)
    with pytest.raises(EaglekitError, match="does not exist"):
        serve.build_engine(load_config(serve.Config, overrides=["target=tiny", f"drafter={tmp_path / 'trian'}"]))


def test_a_method_or_option_that_cannot_work_is_refused_before_the_target_loads(drafter_dir, tmp_path, monkeypatch):
    """generate and serve read the decode options and the saved drafter's config before loading any model: a method
    the drafter does not draft with, an option the method has no use for, and one the drafter's config cannot draft
    with (a chain longer than its block, more Markov candidates than draft ids) are one error each. Left at auto,
    the method is the drafter's own."""
    import eaglekit.targets.loading
    from eaglekit.config import load_config
    from eaglekit.stages import serve

    def no_loading(*args, **kwargs):
        raise AssertionError("the target was loaded before the request was checked")

    monkeypatch.setattr(eaglekit.targets.loading, "load_target", no_loading)
    monkeypatch.setattr(serve.HFBackend, "load", no_loading)
    cases = {("method=dspark",): "method=dspark needs a drafter of type dspark; this drafter is eagle3",
             ("draft_topk=4",): "draft_topk=4 picks the candidates of a Markov head's correction, which method=tree",
             ("method=plain", "draft_topk=4"): "which method=plain has none of",
             ("method=chain", "verify_threshold=0.5"): "verify_threshold=0.5 cuts a chain by the drafter's calibrated"}
    for options, message in cases.items():
        code, stderr = run_main("generate", "x = 1", "target=tiny", f"drafter={drafter_dir}", *options, cwd=tmp_path)
        assert code == 1
        one_error(stderr, message)
        if options[0] != "method=plain":  # serve: plain is a server without drafter=
            with pytest.raises(EaglekitError, match=message.split(";")[0]):
                serve.build_engine(load_config(serve.Config, overrides=["target=tiny", f"drafter={drafter_dir}",
                                                                         *options]))
    with pytest.raises(EaglekitError, match="which method=plain has none of"):
        serve.build_engine(load_config(serve.Config, overrides=["target=tiny", "draft_topk=4"]))
    dspark = tmp_path / "dspark"  # what its config.json cannot draft: read without its weights
    DSparkDrafter(DSparkConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
        vocab_size=128, draft_vocab_size=64, target_hidden_size=32, target_layer_ids=(1,), mask_token_id=127,
        block_size=4, target_num_layers=4, markov_rank=8, confidence_head=False)).save_pretrained(dspark)
    cases = {("chain_length=5",): "chain_length=5: this DSpark drafter's block makes at most 4 drafts",
             ("draft_topk=65",): "draft_topk=65: this DSpark drafter has 64 draft ids",
             ("verify_threshold=0.5",): "verify_threshold=0.5 needs the drafter's confidence head"}
    for options, message in cases.items():
        code, stderr = run_main("generate", "x = 1", "target=tiny", f"drafter={dspark}", "method=dspark", *options,
                                cwd=tmp_path)
        assert code == 1
        one_error(stderr, message)
    from eaglekit.decode.setup import check_request  # method=auto (the default): the drafter's own, plain without

    assert [check_request("auto", drafter) for drafter in (str(drafter_dir), str(dspark), "")] == \
        ["tree", "dspark", "plain"]


def test_stages_refuse_foreign_folders_and_resume_their_own(drafter_dir, chat_target, data, tmp_path, capsys):
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "holiday.jpg").write_bytes(b"\xff\xd8")
    before = snapshot(tmp_path)
    for args in (("import", str(drafter_dir), f"output={foreign}"),
                 ("vocab", str(data), f"target={chat_target}", f"output={foreign}"),
                 ("train", f"target={chat_target}", f"data={data}", f"output={foreign}"),
                 ("run", f"target={chat_target}", f"data={data}", f"out={foreign}")):
        in_process(capsys, *args)  # noqa: B018 - asserts exit 1 and one error line
    assert_unchanged(before, tmp_path)
    legacy = tmp_path / "legacy-run"  # a run directory written before owner files: still the run's own
    (legacy / "regen").mkdir(parents=True)
    (legacy / "run.yaml").write_text("target: tiny\n")
    assert claim_output(legacy, "run") == legacy
    own = tmp_path / "vocab"
    for _ in range(2):  # the second run rewrites its own folder
        assert main(["vocab", str(data), f"target={chat_target}", f"output={own}"]) == 0
    assert main(["vocab", str(data), f"target={chat_target}", f"output={foreign}", "overwrite=true"]) == 0
    assert (foreign / "holiday.jpg").is_file() and (foreign / "vocab.safetensors").is_file()


# ---- 3. a drafter made for another target --------------------------------------------------------

def test_generate_refuses_a_drafter_made_for_another_target(drafter_dir, tmp_path):
    before = snapshot(drafter_dir)
    code, stderr = run_main("generate", "hello", "target=tiny", f"drafter={drafter_dir}", "max_new_tokens=4",
                            cwd=tmp_path)
    assert code == 1
    one_error(stderr, "was made for another target", "4 layers vs 8", "hidden size 32 vs 128", "vocabulary")
    assert_unchanged(before, drafter_dir)


def test_a_drafter_whose_target_only_has_another_name_is_used_with_a_warning(chat_target, tmp_path, caplog):
    from transformers import AutoConfig

    from eaglekit.drafters.eagle3.model import Eagle3Drafter
    from eaglekit.formats.saved import check_drafter_target

    drafter = Eagle3Drafter.from_pretrained(save_drafter(tmp_path / "d", chat_target, "org/other-model"))
    with caplog.at_level(logging.WARNING):
        check_drafter_target(drafter.config, AutoConfig.from_pretrained(chat_target), "d", chat_target)
    assert "was trained for org/other-model" in caplog.text
    caplog.clear()
    check_drafter_target(drafter.config, AutoConfig.from_pretrained(chat_target), "d", "/models/other-model")
    assert not caplog.text  # the same model under another path: no warning


# ---- 4. a mistyped local path --------------------------------------------------------------------

def test_a_mistyped_local_target_is_one_immediate_error(data, tmp_path, capsys, monkeypatch):
    (tmp_path / "models" / "llama").mkdir(parents=True)
    before = snapshot(tmp_path)
    code, stderr = cli("train", "target=models/lama", f"data={data}", "output=out", cwd=tmp_path)
    assert code == 1
    one_error(stderr, "target models/lama does not exist", "did you mean models/llama?")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = in_process(capsys, "vocab", str(data), "target=some-org/not-downloaded", f"output={tmp_path / 'v'}")
    assert "not in the Hugging Face cache" in line and "unset HF_HUB_OFFLINE" in line
    assert_unchanged(before, tmp_path)


def test_a_hub_target_is_handed_to_an_engine_as_its_cached_snapshot(tmp_path, monkeypatch):
    """vLLM loads the target itself from a folder: a hub id becomes its snapshot in the Hugging Face cache (as
    eaglekit's own loading left it), and one that is not cached is one error naming the download."""
    import shutil

    from eaglekit.targets.loading import local_model_dir, tiny_target_path

    repo = tmp_path / "hub" / "models--some-org--tiny"
    shutil.copytree(tiny_target_path(), repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # read once, when huggingface_hub loads
    assert local_model_dir("some-org/tiny") == str(repo / "snapshots" / "abc123")
    assert local_model_dir("tiny") == str(tiny_target_path())
    with pytest.raises(EaglekitError, match=r"some-org/other is no local directory and not in the Hugging Face "
                                            r"cache: download it first \(`hf download some-org/other`\)"):
        local_model_dir("some-org/other")
