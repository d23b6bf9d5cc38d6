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
