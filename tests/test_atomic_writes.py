"""One way to write a file or a folder atomically and one hash of configs: what every stage uses."""

from __future__ import annotations

import pytest

from eaglekit.manifest import atomic_directory, atomic_path, atomic_write_json, data_hash


class Interrupted(Exception):
    pass


def test_an_interrupted_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "out.json"
    atomic_write_json(path, {"a": 1})
    with pytest.raises(Interrupted):
        with atomic_path(path) as tmp:
            tmp.write_text("half")
            raise Interrupted
    assert path.read_text() == '{\n  "a": 1\n}\n' and sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_a_folder_is_replaced_whole_or_not_at_all(tmp_path):
    folder = tmp_path / "model"
    with atomic_directory(folder) as staging:
        (staging / "weights").write_text("v1")
        assert not folder.exists()  # nothing in place until the block succeeds
    with pytest.raises(Interrupted):
        with atomic_directory(folder) as staging:
            (staging / "weights").write_text("half")
            raise Interrupted
    assert (folder / "weights").read_text() == "v1"
    with atomic_directory(folder) as staging:
        (staging / "other").write_text("v2")
    assert sorted(p.name for p in folder.iterdir()) == ["other"]  # the old folder's files are gone with it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging or set-aside folder left


def test_the_config_hash_is_stable_and_ignores_key_order():
    # the digest stored in earlier runs' records and shards: a changed helper would make every run start over
    assert data_hash({"a": 1, "b": [1, 2]}) == data_hash({"b": [1, 2], "a": 1}) == "e6f20bdc3757e5e7"
    assert data_hash({"a": 1}) != data_hash({"a": 2}) and len(data_hash({})) == 16


def test_every_config_hash_is_the_one_helper():
    """Run keys and target identities hash with data_hash (the same digests as before it was shared)."""
    from dataclasses import dataclass

    from eaglekit.pipeline import step_key
    from eaglekit.targets.identity import target_config_hash

    @dataclass(frozen=True)
    class Options:
        x: int = 1

    assert target_config_hash({"hidden_size": 8, "transformers_version": "5.0"}) == data_hash({"hidden_size": 8})
    assert step_key(Options(), "prev") == data_hash({"config": {"x": 1}, "previous": "prev", "inputs": ""})
