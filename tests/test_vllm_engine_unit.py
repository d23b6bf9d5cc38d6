"""The vLLM engine path without vLLM: finding it, its errors, counters, and stopping every process it starts."""

from __future__ import annotations

import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eaglekit.errors import EaglekitError
from eaglekit.vllm import engine as ve
from eaglekit.vllm.bench import engine_error

METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 184.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 552.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 332.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 111.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 138.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 83.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""
# What prometheus_client itself writes: a counter's `_created` timestamp beside its `_total`; label values holding
# '}', ',', an escaped quote; a timestamp after the value.
METRICS_EXPOSITION = """# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m}, \\"q\\""} 10.0 1700000000000
vllm:spec_decode_num_drafts_created{engine="0",model_name="m}, \\"q\\""} 1.7e+09
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 5.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="a,b}",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_created{model_name="a,b}",position="1"} 1.7e+09
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="a,b}",position="0"} 9.0
"""


def fake_python(tmp_path: Path, body: str) -> str:
    """An executable standing in for vLLM's python: a shell script with `body`."""
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_prometheus_counters_give_tau_and_acceptance_per_position():
    counters = ve.parse_prometheus(METRICS)
    assert counters["spec_decode_num_drafts"] == 184
    assert counters["spec_decode_num_accepted_tokens_per_pos"] == [138, 111, 83]  # ordered by position label
    figures = ve.acceptance(counters)
    assert figures["tau"] == pytest.approx(1 + 332 / 184)
    assert figures["acceptance_per_position"] == pytest.approx([138 / 184, 111 / 184, 83 / 184])
    before = {"spec_decode_num_drafts": 100.0, "spec_decode_num_accepted_tokens_per_pos": [50.0, 40.0, 30.0]}
    delta = ve.counter_delta(counters, before)
    assert delta["spec_decode_num_drafts"] == 84 and delta["spec_decode_num_accepted_tokens_per_pos"] == [88, 71, 53]
    assert ve.acceptance({}) == {"drafts": 0}


def test_prometheus_text_as_the_format_defines_it():
    """Label values with '}' and quotes, `_created` samples and timestamps: every counter read, summed over engines."""
    counters = ve.parse_prometheus(METRICS_EXPOSITION)
    assert counters == {"spec_decode_num_drafts": 15.0, "spec_decode_num_accepted_tokens_per_pos": [9.0, 4.0]}


def test_missing_vllm_names_make_vllm_env(tmp_path, monkeypatch):
    monkeypatch.setattr(ve, "default_python", lambda: None)
    with pytest.raises(EaglekitError, match="make vllm-env"):
        ve.find_engine("")
    with pytest.raises(EaglekitError, match="does not exist.*make vllm-env"):
        ve.find_engine(str(tmp_path / "nowhere" / "python"))
    no_vllm = fake_python(tmp_path, "echo \"ModuleNotFoundError: No module named 'vllm'\" >&2; exit 1")
    with pytest.raises(EaglekitError, match="cannot import vllm .*No module named 'vllm'.*make vllm-env"):
        ve.find_engine(no_vllm)


def test_wrong_vllm_version_names_the_tested_one(tmp_path):
    other = fake_python(tmp_path, "echo 0.11.0")
    with pytest.raises(EaglekitError, match="vLLM 0.11.0.*tested with vLLM 0.32.0.*vllm_version_check=false"):
        ve.find_engine(other)
    assert ve.find_engine(other, check_version=False).version == "0.11.0"
    engine = ve.find_engine(fake_python(tmp_path, "echo 0.32.0+cpu cpu"))
    assert (engine.version, engine.device_type) == ("0.32.0+cpu", "cpu")


def test_each_python_is_probed_once_while_it_stays_the_same(tmp_path):
    """Importing vllm costs seconds: find_engine runs a Python once, and again only when the file changed."""
    runs = tmp_path / "runs"
    python = fake_python(tmp_path, f"echo x >> {runs}; echo 0.32.0 cpu")
    assert ve.find_engine(python).version == ve.find_engine(python).version == "0.32.0"
    assert runs.read_text().count("x") == 1
    fake_python(tmp_path, f"echo x >> {runs}; echo 0.32.0+cpu cpu")
    assert ve.find_engine(python).version == "0.32.0+cpu" and runs.read_text().count("x") == 2


def test_engine_args_follow_the_target(tmp_path):
    import json

    (tmp_path / "mla").mkdir()
    (tmp_path / "mla" / "config.json").write_text(json.dumps({"kv_lora_rank": 512}))
    (tmp_path / "wrapper").mkdir()
    wrapper_config = {"text_config": {"kv_lora_rank": 512}, "vision_config": {}}
    (tmp_path / "wrapper" / "config.json").write_text(json.dumps(wrapper_config))
    assert ve.engine_args(256, tmp_path / "mla")["attention_backend"] == "CPU_MLA"
    assert "attention_backend" not in ve.engine_args(256, tmp_path / "mla", device_type="cuda")
    wrapper = ve.engine_args(256, tmp_path / "wrapper")
    assert wrapper["language_model_only"] and wrapper["attention_backend"] == "CPU_MLA"
    command = ve.serve_command(ve.Engine("py", "0.32.0"), "m", 8000, wrapper, None)
    assert command[command.index("--max-model-len") + 1] == "256"
    assert {"--language-model-only", "--no-enable-prefix-caching", "--enforce-eager"} <= set(command)


def test_started_processes_are_stopped_with_their_children(tmp_path):
    """A process that spawned a child: leaving the block stops both (the whole process group)."""
    pid_file = tmp_path / "child.pid"
    script = (f"import subprocess, time; p = subprocess.Popen(['sleep', '300']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(300)")
    with ve.started([sys.executable, "-c", script], tmp_path / "log.txt") as process:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the child was not started"
            time.sleep(0.1)
        child = int(pid_file.read_text())
        while child not in ve.processes_of(tmp_path):  # found by the marker its environment carries
            assert time.monotonic() < deadline, "the child was not found by its folder"
            time.sleep(0.05)
    assert process.poll() is not None
    assert not alive(child)
    assert ve.processes_of(tmp_path) == []


def test_processes_of_a_folder_are_those_whose_log_lies_inside_it(tmp_path):
    """A folder whose name extends another's (runs/a-2 beside runs/a) holds none of the other's processes."""
    with ve.started(["sleep", "300"], tmp_path / "a-2" / "log.txt") as process:
        deadline = time.monotonic() + 10
        while process.pid not in ve.processes_of(tmp_path / "a-2"):
            assert time.monotonic() < deadline, "the started process was not found by its folder"
            time.sleep(0.05)
        assert process.pid in ve.processes_of(tmp_path) and ve.processes_of(tmp_path / "a") == []
        assert ve._group_members(process.pid) == [process.pid]
    assert ve._group_members(process.pid) == [] and ve.processes_of(tmp_path) == []


def alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it counts as stopped)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.1)
    return True


def test_a_server_that_dies_is_one_error_with_its_log_tail(tmp_path, monkeypatch):
    """`serving` waits for /health; a server process that exits instead is reported with the end of its log."""
    crash = fake_python(tmp_path, "echo 'loading model'; echo 'RuntimeError: out of KV cache space' >&2; exit 3")
    engine = ve.Engine(crash, ve.TESTED_VERSION)
    monkeypatch.setattr(ve, "serve_command", lambda *args: [crash])
    log_path = tmp_path / "serve.log"
    expected = r"exited with code 3 while starting.*serve\.log ends: .*out of KV cache space"
    with pytest.raises(EaglekitError, match=expected):
        with ve.serving(engine, "model", ve.engine_args(256), None, log_path, startup_timeout=60):
            pass


def test_a_server_that_never_answers_is_stopped_after_the_timeout(tmp_path, monkeypatch):
    sleeper = fake_python(tmp_path, "exec sleep 300")
    monkeypatch.setattr(ve, "serve_command", lambda *args: [sleeper])
    started: list[subprocess.Popen] = []
    original = ve.started

    def remember(command, log_path, env=None):
        manager = original(command, log_path, env)
        process = manager.__enter__()
        started.append(process)

        class Wrapper:
            def __enter__(self):
                return process

            def __exit__(self, *exc):
                return manager.__exit__(*exc)
        return Wrapper()

    monkeypatch.setattr(ve, "started", remember)
    with pytest.raises(EaglekitError, match="did not answer /health within 2 s"):
        with ve.serving(ve.Engine(sleeper, ve.TESTED_VERSION), "m", ve.engine_args(256), None, tmp_path / "s.log", 2):
            pass
    assert started and started[0].poll() is not None  # stopped, not orphaned


def test_a_worker_that_fails_reports_its_log(tmp_path):
    broken = fake_python(tmp_path, "echo 'ValueError: bad job' >&2; exit 1")
    with pytest.raises(EaglekitError, match="worker \\(offline\\) exited with code 1.*ValueError: bad job"):
        ve.run_worker(ve.Engine(broken, ve.TESTED_VERSION), {"kind": "version"}, tmp_path, "offline")


def test_a_refused_drafter_quotes_the_engine_and_names_the_doctors_fix(tmp_path):
    """bench's error quotes vLLM and gives the doctor's remedy for the vLLM it ran: `--fix` only where --fix writes
    a plugin (a synthetic vLLM tree stands in for the engine's site-packages)."""
    import json

    fixtures = Path(__file__).parent / "fixtures" / "engines" / "vllm_tree"
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    site.parent.mkdir(parents=True)
    site.symlink_to(fixtures)
    engine = ve.Engine(str(tmp_path / "venv" / "bin" / "python"), "0.32.0")
    targets = {}
    for name in ("ToyVLForConditionalGeneration", "PlainVLForConditionalGeneration"):
        targets[name] = tmp_path / f"{name}.json"
        text = {"model_type": "toy", "num_hidden_layers": 8}
        targets[name].write_text(json.dumps({"architectures": [name], "model_type": "toy_vl", "text_config": text}))
    run = {"name": "vllm_eagle3", "error": "ValueError: Model does not support EAGLE3 interface but "
                                            "aux_hidden_state_outputs was requested"}
    fixable = str(engine_error(run, engine, str(targets["ToyVLForConditionalGeneration"]), tmp_path / "o.log"))
    assert "does not support EAGLE3 interface" in fixable
    assert f"eaglekit doctor --engine vllm --target {targets['ToyVLForConditionalGeneration']} --fix" in fixable
    refused = str(engine_error(run, engine, str(targets["PlainVLForConditionalGeneration"]), tmp_path / "o.log"))
    assert "--fix" not in refused and "the doctor (eaglekit doctor --engine vllm --target" in refused
    assert "PlainVLForConditionalGeneration" in refused
    other = engine_error({"name": "vllm_eagle3", "error": "KeyError: 'fc.weight'"}, engine, "t", tmp_path / "o.log")
    assert "KeyError: 'fc.weight'" in str(other) and "eaglekit doctor --engine vllm --target t" in str(other)


def test_run_report_has_a_served_by_vllm_section_when_bench_ran_with_engine_vllm(tmp_path):
    import json

    from eaglekit.report import write_report

    def level(c, plain, eagle, tau=None):
        return {"concurrency": c, "requests": max(4, c), "new_tokens": 128, "seconds": 1.0,
                "tokens_per_second": eagle if tau else plain, **({"tau": tau} if tau else {})}

    rows = [{"method": "chain", "temperature": 0.0, "tokens_per_second": 20.0, "ms_per_token": 50.0, "tau": 2.804,
             "acceptance_per_position": [0.75, 0.6033, 0.4511]},
            {"method": "vllm_plain", "temperature": 0.0, "engine": "vllm", "engine_version": "0.32.0",
             "tokens_per_second": 200.0,
             "concurrency": [level(1, 200.0, 0), level(4, 600.0, 0)]},
            {"method": "vllm_eagle3", "temperature": 0.0, "engine": "vllm", "engine_version": "0.32.0",
             "tokens_per_second": 300.0,
             "ms_per_token": 3.333,
             "tau": 2.804, "acceptance_per_position": [0.75, 0.6033, 0.4511],
             "concurrency": [level(1, 0, 300.0, 2.804), level(4, 0, 660.0, 2.8)]}]
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "manifest.json").write_text(json.dumps({"stage": "bench"}))
    (tmp_path / "bench" / "bench.json").write_text(json.dumps({
        "rows": rows, "num_prompts": 4, "vllm": {"python": "/venv/bin/python", "version": "0.32.0"},
        "config": {"engine": "vllm", "prompts": "p.jsonl", "max_new_tokens": 32, "repeats": 1, "device": "cpu"}}))
    (tmp_path / "run.json").write_text(json.dumps({"config": {"target": "tiny"}, "steps": []}))
    text = write_report(tmp_path).path.read_text()
    section = text.split("## Served by vLLM", 1)[1]
    assert "vLLM 0.32.0 (`/venv/bin/python`)" in section and "tau 2.804" in section and "0.750 0.603 0.451" in section
    assert "| 1 | 4 | 200.0 | 300.0 | 1.50x | 2.804 |" in section
    assert "| 4 | 4 | 600.0 | 660.0 | 1.10x | 2.800 |" in section
    assert "| vllm_eagle3 | 0 | 300.0 | 3.33 | 1.50x vs vllm_plain |" in text  # against vLLM's own plain decoding
    data = json.loads((tmp_path / "bench" / "bench.json").read_text())
    data["config"]["engine"] = "eaglekit"
    (tmp_path / "bench" / "bench.json").write_text(json.dumps(data))
    assert "## Served by vLLM" not in write_report(tmp_path).path.read_text()


def test_a_started_engine_logs_its_whole_command(tmp_path, caplog):
    command = [sys.executable, "-c", "pass", "--model", str(tmp_path / "my model"), "--speculative-config", '{"a": 1}']
    with caplog.at_level("INFO", logger="eaglekit"), ve.started(command, tmp_path / "engine.log") as process:
        process.wait(timeout=60)
    assert f"'{tmp_path / 'my model'}' --speculative-config '{{\"a\": 1}}'" in caplog.text


@pytest.mark.parametrize("drafter_type, row", [("eagle3", "vllm_eagle3"), ("p-eagle", "vllm_eagle3"),
                                               ("dflash", "vllm_dflash")])
def test_a_failed_vllm_run_is_named_by_the_method_that_serves_the_drafter(tmp_path, drafter_type, row):
    """P-EAGLE is served as eagle3 (parallel drafting), DFlash as dflash: its error row carries that name."""
    import json
    from types import SimpleNamespace

    from eaglekit.stages.bench import _vllm_rows

    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"drafter_type": drafter_type}))
    config = SimpleNamespace(target=str(tmp_path / "no-target"), drafter=str(drafter))
    [failed] = _vllm_rows(config, None, [[1, 2]], tmp_path / "bench")
    assert failed["method"] == row and failed["engine"] == "vllm"
    assert failed["error"].startswith(f"target {tmp_path / 'no-target'} does not exist")


def test_a_drafter_vllm_cannot_read_is_a_failed_row_not_a_failed_bench(tmp_path):
    from types import SimpleNamespace

    from eaglekit.stages.bench import _vllm_rows

    (tmp_path / "foreign").mkdir()
    config = SimpleNamespace(target="tiny", drafter=str(tmp_path / "foreign"))
    [failed] = _vllm_rows(config, None, [[1, 2]], tmp_path / "bench")
    assert failed["method"] == "vllm_eagle3" and "no config.json there" in failed["error"]


def test_a_dflash_drafters_vllm_rows_get_the_served_sweep_and_the_lossless_line():
    from eaglekit.report import vllm_checks_markdown

    def levels(speed):
        return [{"concurrency": 1, "requests": 4, "tokens_per_second": speed, "tau": 3.5 if speed > 100 else None}]

    rows = [{"method": "vllm_plain", "temperature": 0.0, "engine": "vllm", "concurrency": levels(100.0)},
            {"method": "vllm_dflash", "temperature": 0.0, "engine": "vllm", "engine_version": "0.32.0",
             "outputs_equal_plain": 1.0, "concurrency": levels(250.0)}]
    lines = vllm_checks_markdown(rows)
    assert "| concurrency | requests | vllm_plain tokens/s | vllm_dflash tokens/s | speed-up | tau (served) |" in lines
    assert "| 1 | 4 | 100.0 | 250.0 | 2.50x | 3.500 |" in lines
    assert "- T=0: vLLM's output with the drafter equals its plain greedy output on 100% of the prompts" in lines
