"""Resumable runs: finished unchanged steps are skipped, a change re-runs that step and the later ones."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from eaglekit.pipeline import Step, run_steps


@dataclass(frozen=True)
class Cfg:
    value: int


def make_steps(tmp_path, values, calls, fail_at=None):
    def execute(name):
        def go(config):
            calls.append(name)
            (tmp_path / name / "partial").write_text("x")
            if name == fail_at:
                raise KeyboardInterrupt
            return config.value
        return go
    return [Step(n, tmp_path / n, (lambda v=v: Cfg(v)), execute(n)) for n, v in zip("abc", values)]


def test_skip_rerun_and_resume(tmp_path):
    calls: list[str] = []
    records = run_steps(make_steps(tmp_path, [1, 2, 3], calls))
    assert calls == ["a", "b", "c"] and [r.status for r in records] == ["ran"] * 3
    calls.clear()
    assert [r.status for r in run_steps(make_steps(tmp_path, [1, 2, 3], calls))] == ["skipped"] * 3
    assert calls == []
    # changing b re-runs b and c (c's input changed), moving their old folders aside
    run_steps(make_steps(tmp_path, [1, 5, 3], calls))
    assert calls == ["b", "c"]
    assert (tmp_path / "b.old" / "partial").exists() and (tmp_path / "c.old").exists()


def test_interrupted_step_resumes_in_place(tmp_path):
    calls: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        run_steps(make_steps(tmp_path, [1, 2, 3], calls, fail_at="b"))
    assert calls == ["a", "b"]
    calls.clear()
    run_steps(make_steps(tmp_path, [1, 2, 3], calls))
    assert calls == ["b", "c"]  # a skipped; b resumed in its own folder (not moved aside)
    assert not (tmp_path / "b.old").exists() and (tmp_path / "b" / "partial").exists()


def test_after_names_the_steps_a_key_depends_on(tmp_path):
    calls: list[str] = []

    def steps(values):
        go = lambda name: (lambda config: calls.append(name))  # noqa: E731
        return [Step("a", tmp_path / "a", lambda: Cfg(values[0]), go("a")),
                Step("b", tmp_path / "b", lambda: Cfg(values[1]), go("b"), after=("a",)),
                Step("c", tmp_path / "c", lambda: Cfg(values[2]), go("c"), after=("a",))]  # c reads a, not b

    run_steps(steps([1, 2, 3]))
    calls.clear()
    run_steps(steps([1, 7, 3]))
    assert calls == ["b"]  # c does not depend on b
    calls.clear()
    run_steps(steps([4, 7, 3]))
    assert calls == ["a", "b", "c"]


def test_changed_input_file_and_missing_output_rerun(tmp_path):
    calls: list[str] = []
    data = tmp_path / "data.jsonl"
    data.write_text("one\n")

    def produce(config):
        calls.append("a")
        (tmp_path / "a" / "out.txt").write_text("result")

    steps = lambda: [Step("a", tmp_path / "a", lambda: Cfg(1), produce, inputs=(data,), outputs=("out.txt",))]  # noqa: E731
    run_steps(steps())
    run_steps(steps())
    assert calls == ["a"]
    data.write_text("two\n")  # same options, other data: the key changes
    run_steps(steps())
    assert calls == ["a", "a"] and (tmp_path / "a.old" / "out.txt").exists()
    (tmp_path / "a" / "out.txt").unlink()  # a finished step whose output was deleted runs again, in place
    records = run_steps(steps())
    assert calls == ["a", "a", "a"] and records[0].status == "ran" and (tmp_path / "a" / "out.txt").exists()


def test_fingerprint_hashes_small_files_by_content_and_large_ones_by_size(tmp_path, monkeypatch):
    from eaglekit import pipeline

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "weights.bin").write_bytes(b"a" * 64)
    monkeypatch.setattr(pipeline, "HASH_LIMIT", 16)
    before = pipeline.fingerprint([folder])
    (folder / "weights.bin").write_bytes(b"b" * 64)  # same size, large: not re-hashed
    assert pipeline.fingerprint([folder]) == before
    (folder / "config.json").write_text("{ }")
    changed = pipeline.fingerprint([folder])
    assert changed != before
    (folder / ".run-key").write_text("x")  # hidden files are ignored
    assert pipeline.fingerprint([folder]) == changed


def test_git_commit_prefers_the_named_tree(monkeypatch):
    """A copied working tree (a GPU box) names its commit; a stale .git there must not win."""
    from eaglekit.manifest import git_commit

    monkeypatch.setenv("EAGLEKIT_COMMIT", "6a52322")
    assert git_commit() == "6a52322"
    monkeypatch.delenv("EAGLEKIT_COMMIT")
    assert git_commit() != "6a52322"


class _FakeCuda:
    """torch.cuda as `pipeline._gpu_peak` sees it on a machine with two GPUs in use."""

    def __init__(self):
        self.peaks, self.resets = [3_000_000_000, 5_000_000_000], []

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def device_count(self):
        return 2

    def max_memory_allocated(self, device):
        return self.peaks[device]

    def reset_peak_memory_stats(self, device):
        self.resets.append(device)
        self.peaks[device] = 0


def test_peak_gpu_memory_is_recorded_per_step(tmp_path, monkeypatch):
    """Each step that ran records the most GPU memory any device held during it (peaks are reset between
    steps); a skipped step keeps the figure of the run that made it; without CUDA in use it is None."""
    import sys
    import types

    calls: list[str] = []
    records = run_steps(make_steps(tmp_path / "cpu", [1, 2, 3], calls))
    assert [r.peak_gpu_bytes for r in records] == [None] * 3

    cuda = _FakeCuda()
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    steps = make_steps(tmp_path / "gpu", [1, 2], calls)

    def heavy(config):  # the step's own work raises device 0's peak
        cuda.peaks[0] = 7_000_000_000
    steps[1].execute = heavy
    records = run_steps(steps)
    assert [r.peak_gpu_bytes for r in records] == [0, 7_000_000_000]  # earlier use was reset before step a
    assert cuda.resets.count(0) == 4  # before and after each step
    again = run_steps(make_steps(tmp_path / "gpu", [1, 2], calls))
    assert [(r.status, r.peak_gpu_bytes) for r in again] == [("skipped", 0), ("skipped", 7_000_000_000)]
