"""Which target names are hub ids: huggingface_hub's own rule (validate_repo_id), so a name the hub refuses is
reported at once as a missing path, never sent to the hub."""

from __future__ import annotations

import pytest

from eaglekit.targets.loading import is_hub_id, looks_local


@pytest.mark.parametrize("name, hub_id", [
    ("meta-llama/Llama-3.1-8B-Instruct", True), ("gpt2", True), ("org_x/model.v2", True),
    ("org/name/extra", False), ("org--x/model", False), ("org/model..v2", False), ("org/model.git", False),
    ("o" * 97, False), ("org/", False), ("", False),
])
def test_hub_ids_are_what_the_hub_accepts(name, hub_id):
    assert is_hub_id(name) is hub_id


def test_a_name_the_hub_refuses_is_a_local_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert not looks_local("org/model") and not looks_local("org_x/model.v2")
    assert looks_local("org--x/model") and looks_local("./model") and looks_local("a/b/c")
    (tmp_path / "runs").mkdir()
    assert looks_local("runs/trian")  # an existing folder's child: a mistyped path, not a hub id
