"""A hub id that cannot be loaded is one error line at once: what was looked for, where, and the fix; never a
minute of retries (docs/errors.md, "a hub id that is not cached"). The hub is replaced by an HTTP transport that
answers as the hub does, so these tests run offline and count every request made."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx2
import pytest
from huggingface_hub import constants, set_client_factory

from eaglekit.errors import EaglekitError
from eaglekit.targets import loading
from eaglekit.targets.loading import locate_target, tiny_target_path


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty Hugging Face cache, offline mode off, and a fake hub: `hub.answer(request)` -> httpx2.Response, or
    raises; `hub.requests` lists the models' URLs asked for."""

    class Hub:
        requests: list[str] = []
        answer = None

        def handle(self, request: httpx2.Request) -> httpx2.Response:
            if "/api/models/" in request.url.path:  # not huggingface_hub's own user-agent look-up
                self.requests.append(str(request.url))
            return self.answer(request)

    fake = Hub()
    fake.requests = []
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(fake.handle)))
    loading.hub_problem.cache_clear()
    yield fake
    set_client_factory(httpx2.Client)
    loading.hub_problem.cache_clear()


def _status(code: int, error_code: str = ""):
    headers = {"X-Error-Code": error_code} if error_code else {}
    return lambda request: httpx2.Response(code, headers=headers, json={"error": error_code or "error"})


def _unreachable(request: httpx2.Request) -> httpx2.Response:
    raise httpx2.ConnectError("[Errno -2] Name or service not known", request=request)


def _cache(repo_id: str, root: Path) -> Path:
    """`repo_id` in the cache at `root`, as a download leaves it (a snapshot and refs/main)."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(tiny_target_path(), repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    return repo / "snapshots" / "abc123"


def test_no_network_is_one_request_and_one_line(hub):
    hub.answer = _unreachable
    with pytest.raises(EaglekitError) as error:
        locate_target("some-org/not-downloaded")
    assert str(error.value) == (
        f"target some-org/not-downloaded is no local directory and not in the Hugging Face cache "
        f"({constants.HF_HUB_CACHE}), and {constants.ENDPOINT} cannot be reached: fix the path, or download it where "
        "there is a network (`hf download some-org/not-downloaded`)")
    assert len(hub.requests) == 1  # no retries


def test_a_mistyped_local_name_names_the_folder_it_resembles(hub, tmp_path, monkeypatch):
    (tmp_path / "my-model").mkdir()
    monkeypatch.chdir(tmp_path)
    hub.answer = _status(401, "RepoNotFound")
    with pytest.raises(EaglekitError, match=r"target my-modle is no local directory \(did you mean my-model\?\) and "
                                            r"not in the Hugging Face cache, and the hub has no model of that name "
                                            r"\(a private one needs HF_TOKEN or `hf auth login`\): fix the path"):
        locate_target("my-modle")
    assert len(hub.requests) == 1


def test_a_gated_model_asks_for_the_token(hub):
    def answer(request: httpx2.Request) -> httpx2.Response:
        if request.url.path.endswith("/auth-check"):
            return _status(403, "GatedRepo")(request)
        return httpx2.Response(200, json={"id": "org/gated", "gated": "manual", "private": False})

    hub.answer = answer
    with pytest.raises(EaglekitError, match=r"it is gated on the hub: accept its terms on its hub page, then set "
                                            r"HF_TOKEN \(or run `hf auth login`\)"):
        locate_target("org/gated")


def test_a_served_model_goes_to_the_loaders_and_a_cached_one_is_read_without_the_hub(hub, tmp_path):
    hub.answer = lambda request: httpx2.Response(200, json={"id": "org/open", "private": False})
    assert locate_target("org/open") == "org/open"
    snapshot = _cache("org/cached", tmp_path / "hub")
    hub.answer = _unreachable
    assert locate_target("org/cached") == str(snapshot)
    assert locate_target("tiny") == str(tiny_target_path())
    assert len(hub.requests) == 2  # one per hub id, none for a local folder


def test_offline_mode_never_asks_the_hub(hub, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.answer = _unreachable
    with pytest.raises(EaglekitError, match=r"offline mode is on \(HF_HUB_OFFLINE=1\): fix the path, or unset "
                                            r"HF_HUB_OFFLINE to download it"):
        locate_target("some-org/not-downloaded")
    assert hub.requests == []


def test_the_cli_prints_that_line_alone(hub, tmp_path, monkeypatch, capsys, caplog):
    """No retry or HTTP log lines around it: the real HTTP client, a hub address where nothing listens."""
    from eaglekit.cli import main

    set_client_factory(httpx2.Client)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    data = tmp_path / "data.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert main(["vocab", str(data), "target=some-org/not-downloaded", f"output={tmp_path / 'vocab'}"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "eaglekit vocab: error: target some-org/not-downloaded is no local directory and not in the Hugging Face "
        f"cache ({tmp_path / 'hub'}), and http://127.0.0.1:9 cannot be reached: fix the path, or download it where "
        "there is a network (`hf download some-org/not-downloaded`)"]
    assert not [r for r in caplog.records if not r.name.startswith("eaglekit")], caplog.text


def test_the_targets_embeddings_and_an_imports_target_go_through_the_same_check(hub, tmp_path):
    """Offline training reads the target's embedding and lm_head, and import reads its config: a cached hub id with
    no network is read from the cache after one request; one that is not cached is the one error line."""
    from eaglekit.training.target_weights import load_target_embeddings
    from eaglekit.stages.import_ import _target_layers

    snapshot = _cache("org/cached", tmp_path / "hub")
    hub.answer = _unreachable
    embed, head = load_target_embeddings("org/cached")
    expected_embed, expected_head = load_target_embeddings(str(snapshot))
    assert embed.equal(expected_embed) and head.equal(expected_head)
    assert _target_layers("org/cached", False)[0] == _target_layers(str(snapshot), False)[0]
    with pytest.raises(EaglekitError, match=r"^target org/missing is no local directory .* cannot be reached"):
        load_target_embeddings("org/missing")
    with pytest.raises(EaglekitError, match=r"^target org/missing is no local directory .* cannot be reached"):
        _target_layers("org/missing", False)
    assert len(hub.requests) == 2  # one per hub id, no retries
