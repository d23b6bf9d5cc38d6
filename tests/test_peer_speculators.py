"""benchmarks/peer_speculators.py's CPU launcher: speculators' accelerator index means the CPU, nothing else changes."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_peer_script():
    spec = importlib.util.spec_from_file_location("peer_speculators", ROOT / "benchmarks" / "peer_speculators.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_launcher_runs_the_peer_module_with_its_accelerator_index_on_the_cpu(tmp_path):
    peer = load_peer_script()
    fake = tmp_path / "speculators"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    # what speculators' trainer does on its device (trainer.py:348, :533, :80), then reports where things went
    (fake / "__main__.py").write_text(textwrap.dedent("""
        import sys, torch
        model = torch.nn.Linear(2, 2).to(0)
        batch = torch.ones(1, 2).to(0, non_blocking=True)
        half = torch.ones(1).to(torch.float16)
        torch.accelerator.synchronize()
        print(sys.argv[1:], model.weight.device, batch.device, half.dtype)
    """))
    env = dict(os.environ, PYTHONPATH=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", peer.CPU_LAUNCHER, "train", "--seed", "0"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['train',", "'--seed',", "'0']", "cpu", "cpu", "torch.float16"]
    shown = peer.shown([sys.executable, "-c", peer.CPU_LAUNCHER, "train"])
    assert shown == [sys.executable, "-c", "<peer_speculators.CPU_LAUNCHER>", "train"]


def test_variant_options_keep_lists_whole():
    peer = load_peer_script()
    assert peer.variant_options("freeze_lm_head=true,betas=[0.9,0.999],grad_clip=1.0") == [
        "freeze_lm_head=true", "betas=[0.9,0.999]", "grad_clip=1.0"]
    assert peer.variant_options("lm_head_init=random") == ["lm_head_init=random"]


def test_train_peer_runs_meanwhile_beside_the_peer_and_kills_it_if_meanwhile_fails(tmp_path):
    import time

    import pytest

    peer = load_peer_script()
    save = tmp_path / "peer" / "checkpoints"
    # the peer writes a marker after a pause: `meanwhile` runs while it is still going
    marker = tmp_path / "peer" / "marker"
    slow = [sys.executable, "-c", f"import time, pathlib; time.sleep(1); pathlib.Path({str(marker)!r}).write_text('done')"]
    seen = []
    result = peer.train_peer(slow, save, "cpu", lambda: seen.append(marker.exists()))
    assert seen == [False] and marker.read_text() == "done"
    assert result["returncode"] == 0 and "no checkpoint" in result["error"]["exception"]

    def fails():
        raise RuntimeError("variant failed")

    started = time.perf_counter()
    with pytest.raises(RuntimeError, match="variant failed"):
        peer.train_peer([sys.executable, "-c", "import time; time.sleep(60)"], save, "cpu", fails)
    assert time.perf_counter() - started < 30  # killed, not waited for
