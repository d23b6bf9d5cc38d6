"""The decoder drafts what the training forward computes: at every step of a decode, a block drafter's drafts equal
those of the training blocks (`eaglekit.drafters.dflash.train`: block tokens, positions and masks over the target's
captured states) at the step's start, at every position; benchmarks/block_probe.py measures the same agreement on a
trained drafter."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from builders import tiny_target
from eaglekit.decode import Decoder, drafter_aux_layers
from eaglekit.drafters.dspark import decode as dspark_decode
from test_dflash_decode import dflash_for
from test_dspark_decode import PROMPTS, dspark_for

ROOT = Path(__file__).resolve().parents[1]


def load_probe():
    spec = importlib.util.spec_from_file_location("block_probe", ROOT / "benchmarks" / "block_probe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["block_probe"] = module
    spec.loader.exec_module(module)
    return module


probe = load_probe()


@pytest.mark.parametrize("backend", ["eager", "static"])
@pytest.mark.parametrize("layout", [{}, {"sample_from_anchor": False}, {"markov_head_type": "rnn"}])
def test_dspark_decode_drafts_what_training_blocks_compute(backend, layout, monkeypatch) -> None:
    """Every draft of every step (the Markov head fed the decoder's own drafts) equals the training forward's at the
    step's start, with a draft vocabulary smaller than the target's and a block of 6."""
    target = tiny_target("llama")
    drafter = dspark_for(target, block_size=6, draft_vocab=48, **layout)
    recorded: list[torch.Tensor] = []
    chain = dspark_decode.markov_chain

    def recording(drafter, hidden, root_token, *args):
        drafts, probs, confidences = chain(drafter, hidden, root_token, *args)
        recorded.append(torch.cat([root_token.reshape(1), drafts]))
        return drafts, probs, confidences

    monkeypatch.setattr(dspark_decode, "markov_chain", recording)
    _, k = probe.num_drafts(drafter)
    decoder = Decoder(target, drafter, backend, max_length=64)
    for prompt in PROMPTS:
        recorded.clear()
        result = decoder.generate(prompt, 24, method="dspark", chain_length=k)
        ids = torch.tensor(prompt + result.tokens)
        starts = torch.tensor(probe.step_starts(len(prompt), result.stats.accepted))
        assert len(recorded) == len(starts)
        chains = torch.stack(recorded)  # (N, K+1) bonus token and drafts
        assert torch.equal(chains[:, 0], ids[starts])  # each step's block starts at its bonus token
        padded = torch.cat([ids, ids.new_zeros(k + 1)])  # blocks of the last steps reach past the answer
        aux = probe.capture_aux(target, padded[None], drafter_aux_layers(drafter))
        forced = probe.block_drafts(drafter, aux, padded[None], starts[None], prev=chains[None, :, :-1])
        assert torch.equal(forced, chains[:, 1:])


def test_dflash_decode_drafts_what_training_blocks_compute() -> None:
    target = tiny_target("llama")
    drafter = dflash_for(target, block_size=6, draft_vocab=48)
    _, k = probe.num_drafts(drafter)
    for prompt in PROMPTS:
        result = Decoder(target, drafter).generate(prompt, 24, method="dflash", chain_length=k)
        ids = torch.tensor(prompt + result.tokens)
        starts = torch.tensor(probe.step_starts(len(prompt), result.stats.accepted))
        room = starts + k < len(ids)
        aux = probe.capture_aux(target, ids[None], drafter_aux_layers(drafter))
        forced = probe.accepted_lengths(probe.block_drafts(drafter, aux, ids[None], starts[room][None]), ids,
                                        starts[room])
        assert forced == torch.tensor(result.stats.accepted)[room].tolist()


def test_probe_reports_decode_and_training_forward_side_by_side() -> None:
    target = tiny_target("llama")
    drafter = dspark_for(target, block_size=6, draft_vocab=48)
    found = probe.probe(target, drafter, PROMPTS, 24, (), ["eager", "static"], compile=False)
    assert found["method"] == "dspark" and found["drafts"] == 6
    assert found["decoded"]["eager"] == found["decoded"]["static"]
    assert found["teacher_forced_at_decode_anchors"]["agree"] == 1.0
    for part in (found["decoded"]["eager"], found["teacher_forced_all_anchors"]):
        assert part["tau"] == pytest.approx(1 + sum(part["acceptance"]))
    assert probe.summary([0, 2, 3, 1], 3)["conditional"] == pytest.approx([0.75, 2 / 3, 0.5])


def test_probe_takes_answers_shorter_than_a_block() -> None:
    target = tiny_target("llama")
    drafter = dspark_for(target, block_size=6, draft_vocab=48)
    found = probe.probe(target, drafter, PROMPTS, 3, (), ["eager"], compile=False)  # an answer ending early
    assert found["decoded"]["eager"]["steps"] > 0 and found["teacher_forced_all_anchors"]["steps"] == 0


def test_probe_command_on_a_saved_drafter_in_the_dtype_asked(tmp_path, tiny_answers) -> None:
    import json

    from engines import train_drafter
    from eaglekit.data.readers import SHIPPED_DATA
    from eaglekit.targets.loading import tiny_target_path

    drafter = train_drafter("tiny", tmp_path / "dspark", steps=2, data=tiny_answers, drafter_type="dspark",
                            block_size=3, draft_layers=1)
    out = tmp_path / "probe.json"
    probe.main(["--target", str(tiny_target_path()), "--prompts", str(SHIPPED_DATA["tiny-eval"]), "--drafter", drafter,
                "--num-prompts", "2", "--max-new-tokens", "6", "--dtype", "bf16", "--out", str(out)])
    found = json.loads(out.read_text())
    assert found["dtype"] == "torch.bfloat16" and found["num_prompts"] == 2
    assert found["drafters"][drafter]["method"] == "dspark" and found["drafters"][drafter]["decoded"]["eager"]["steps"]
