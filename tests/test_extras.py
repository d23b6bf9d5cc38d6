"""The optional packages (datasets, matplotlib, accelerate) are extras of the package; a missing one is one error
line naming the extra to install (plots: a warning, and the outputs are written without them)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from eaglekit.errors import EaglekitError
from eaglekit.extras import EXTRAS, pyplot, require

ROOT = Path(__file__).resolve().parents[1]


def missing(monkeypatch, *packages: str) -> None:
    """Make `import package` fail as it does where the package is not installed."""
    for package in packages:
        for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.setitem(sys.modules, package, None)


def test_pyproject_declares_each_optional_package_as_an_extra_and_the_tests_install_them():
    try:
        import tomllib
    except ImportError:
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = " ".join(project["dependencies"])
    extras = project["optional-dependencies"]
    for package, extra in EXTRAS.items():
        assert package not in required and any(spec.startswith(package) for spec in extras[extra])
    from packaging.requirements import Requirement

    assert "eaglekit[all]" in extras["test"] and Requirement(extras["all"][0]).extras == set(EXTRAS.values())


def test_a_dataset_without_datasets_names_the_extra(tmp_path, monkeypatch):
    from eaglekit.data.readers import read_conversations

    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "dataset_dict.json").write_text("{}")
    missing(monkeypatch, "datasets")
    with pytest.raises(EaglekitError, match=r"reading .*saved.* needs the `datasets` package.*"
                                            r"pip install 'eaglekit\[data\]'"):
        read_conversations(saved)


def test_device_map_without_accelerate_names_the_extra_before_loading(monkeypatch):
    from eaglekit.targets.loading import load_target

    missing(monkeypatch, "accelerate")
    with pytest.raises(EaglekitError, match=r"device_map=auto needs the `accelerate`.*'eaglekit\[multi-gpu\]'"):
        load_target("no/such-model", device_map="auto")  # refused before the target is looked for


def test_plots_without_matplotlib_are_skipped_with_one_warning(tmp_path, monkeypatch, caplog):
    from eaglekit.report import plot_acceptance, plot_training
    from eaglekit.stages.bench import _plot

    missing(monkeypatch, "matplotlib")
    metrics = {"train": [{"step": 1, "loss": 1.0, "acc_k": [0.5]}], "val": []}
    with caplog.at_level(logging.WARNING, logger="eaglekit.extras"):
        assert plot_training(metrics, tmp_path / "training.png") is False
        assert plot_acceptance([], {"acc_k": [0.5]}, tmp_path / "acceptance.png") is False
        _plot([{"method": "plain", "temperature": 0.0, "tokens_per_second": 1.0}], tmp_path / "bench.png")
    assert list(tmp_path.iterdir()) == []
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all("pip install 'eaglekit[plots]'" in w for w in warnings), warnings
    assert warnings[1].startswith("bench.png not drawn")


def test_require_gives_the_module_when_installed():
    assert require("json", "anything").dumps([]) == "[]"
    assert pyplot("a test plot") is not None
