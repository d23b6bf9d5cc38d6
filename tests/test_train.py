"""Training stage on a tiny random chat target: outputs, exact resume, offline == online, init_from and
vocabulary remapping, and every bad input the stage must refuse clearly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from builders import killed_and_resumed, write_random_chats

from eaglekit.config import load_config
from eaglekit.drafters.eagle3.build import with_vocab
from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
from eaglekit.training.vocab import VocabMapping, load_vocab, mapping_from_drafter, save_vocab
from eaglekit.errors import EaglekitError
from eaglekit.stages import train as stage

@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_random_chats(tmp_path_factory.mktemp("train_data") / "chat.jsonl", 20, (4, 12))


def options(chat_target, data_file, out, **extra):
    base = {"target": chat_target, "data": [str(data_file)], "output": str(out), "batch_size": 4, "epochs": 1,
            "ttt_steps": 3, "draft_vocab_size": 64, "val_fraction": 0.2, "lr": 1e-3, "warmup_steps": 1}
    return load_config(stage.Config, overrides={**base, **extra})


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_online_training_writes_a_loadable_drafter(chat_target, data_file, tmp_path):
    result = stage.run(options(chat_target, data_file, tmp_path / "run"))
    out = tmp_path / "run"
    for name in ("config.json", "model.safetensors", "vocab.safetensors", "config.yaml", "manifest.json", "metrics.jsonl"):
        assert (out / name).is_file(), name
    assert result["train_records"] == 16 and result["val_records"] == 4 and result["steps"] == 4
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage"] == "train" and manifest["mode"] == "online" and manifest["aux_layer_ids"] == [1, 2, 3]
    val = [m for m in metrics(out) if m["split"] == "val"][-1]
    running, tau = 1.0, 1.0
    for acc in val["acc_k"]:
        running *= acc
        tau += running
    assert len(val["acc_k"]) == 3 and val["tau"] == pytest.approx(tau)
    drafter = Eagle3Drafter.from_pretrained(out)
    from eaglekit.targets.loading import load_target

    target = load_target(chat_target)
    assert torch.equal(drafter.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(mapping_from_drafter(drafter).used_ids, load_vocab(out).used_ids)
    assert drafter.config.num_key_value_heads == 2 and drafter.config.intermediate_size == 64
    with pytest.raises(EaglekitError, match="resume=true"):
        stage.run(options(chat_target, data_file, out))


def test_killed_and_resumed_run_matches_an_uninterrupted_one(chat_target, data_file, tmp_path):
    common = {"epochs": 2, "save_every": 2, "grad_accum": 2, "batch_size": 2, "log_every": 1}

    def after_kill() -> None:
        assert json.loads((tmp_path / "b/checkpoints/latest.json").read_text())["step"] == 2

    a, b = killed_and_resumed(lambda out, **more: options(chat_target, data_file, out, **common, **more), tmp_path,
                              after_kill=after_kill)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    steps = [m["step"] for m in metrics(tmp_path / "b") if m["split"] == "train"]
    assert steps == [1, 2, 3, 3, 4, 5, 6, 7, 8]  # the resumed run restarted after step 2, not from scratch


def test_offline_shards_give_the_same_loss_as_online(chat_target, data_file, tmp_path):
    from eaglekit.stages import extract

    store = tmp_path / "store"
    extract.run(load_config(extract.Config, overrides={"data": [str(data_file)], "output": str(store), "target": chat_target,
                                                         "dtype": "fp32", "max_length": 256}))
    stage.run(options(chat_target, data_file, tmp_path / "on", max_steps=2))
    stage.run(options(chat_target, data_file, tmp_path / "off", max_steps=2, data=[], shards=str(store)))
    online, offline = metrics(tmp_path / "on"), metrics(tmp_path / "off")
    assert [m["split"] for m in offline] == [m["split"] for m in online]
    for a, b in zip(online, offline):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4) and a["acc_k"] == pytest.approx(b["acc_k"])
    # shards from layers other than the drafter's are refused
    with pytest.raises(EaglekitError, match="aux_layer_ids"):
        stage.run(options(chat_target, data_file, tmp_path / "bad", data=[], shards=str(store), aux_layer_ids=[2, 2, 1]))


def test_init_from_keeps_mapping_and_remaps_on_request(chat_target, data_file, tmp_path):
    stage.run(options(chat_target, data_file, tmp_path / "first", max_steps=1))
    first = Eagle3Drafter.from_pretrained(tmp_path / "first")
    used = mapping_from_drafter(first).used_ids
    unused = torch.tensor([i for i in range(first.config.vocab_size) if i not in set(used.tolist())])
    other = VocabMapping(torch.sort(torch.cat([used[:40], unused[:24]])).values, first.config.vocab_size)
    save_vocab(tmp_path / "other.safetensors", other)
    with pytest.raises(EaglekitError, match="rebuild_vocab=true"):
        stage.run(options(chat_target, data_file, tmp_path / "x", init_from=str(tmp_path / "first"), vocab=str(tmp_path / "other.safetensors")))
    kept = stage.run(options(chat_target, data_file, tmp_path / "kept", max_steps=1, init_from=str(tmp_path / "first"), draft_vocab_size=32))
    assert torch.equal(mapping_from_drafter(Eagle3Drafter.from_pretrained(tmp_path / "kept")).used_ids, used)
    assert kept["steps"] == 1
    remapped, carried = with_vocab(first, other, seed=0)
    assert carried == 40
    for draft_id, target_id in enumerate(other.used_ids.tolist()):
        if target_id in used.tolist():
            old_row = first.lm_head.weight[used.tolist().index(target_id)]
            assert torch.equal(remapped.lm_head.weight[draft_id], old_row)
    assert torch.equal(remapped.fc.weight, first.fc.weight) and torch.equal(remapped.d2t, other.d2t)


def test_bad_inputs_are_refused(chat_target, data_file, tmp_path):
    with pytest.raises(EaglekitError, match="fewer than one batch"):
        stage.run(options(chat_target, data_file, tmp_path / "small", batch_size=64))
    with pytest.raises(EaglekitError, match="exactly one data source"):
        stage.run(options(chat_target, data_file, tmp_path / "none", data=[]))
    foreign = Eagle3Drafter(DrafterConfig(16, 32, 2, 2, 301, 8, 16, (2, 2, 1)))
    foreign.save_pretrained(tmp_path / "foreign")
    with pytest.raises(EaglekitError, match="hidden size 16"):
        stage.run(options(chat_target, data_file, tmp_path / "f", init_from=str(tmp_path / "foreign")))
    from eaglekit.training.loop import train

    def diverge(step: int, trainer) -> None:  # weights blow up after step 1 has been checkpointed
        if step == 1:
            with torch.no_grad():
                trainer.drafter.fc.weight.fill_(float("nan"))

    with pytest.raises(EaglekitError, match=r"loss became nan at step 2.*step-00000001"):
        train(options(chat_target, data_file, tmp_path / "nan", save_every=1), step_callback=diverge)
    good = load_file(str(tmp_path / "nan/checkpoints/step-00000001/model.safetensors"))
    assert all(bool(torch.isfinite(t).all()) for t in good.values() if t.is_floating_point())


def test_lm_head_starts_from_the_targets_rows_and_can_stay_frozen(chat_target, data_file, tmp_path):
    from eaglekit.targets.loading import load_target

    head = load_target(chat_target, "cpu", torch.float32).get_output_embeddings().weight.detach()
    for freeze in (False, True):
        out = tmp_path / f"freeze-{freeze}"
        stage.run(options(chat_target, data_file, out, freeze_lm_head=freeze))
        drafter = Eagle3Drafter.from_pretrained(out)
        rows = head[drafter.draft_to_target(torch.arange(drafter.config.draft_vocab_size))]
        # frozen: exactly the target's rows of the draft vocabulary; trained: moved away from them, not far
        assert torch.equal(drafter.lm_head.weight, rows) == freeze
        assert (drafter.lm_head.weight - rows).norm() < 0.5 * rows.norm()
    stage.run(options(chat_target, data_file, tmp_path / "random", lm_head_init="random"))
    drafter = Eagle3Drafter.from_pretrained(tmp_path / "random")
    rows = head[drafter.draft_to_target(torch.arange(drafter.config.draft_vocab_size))]
    assert (drafter.lm_head.weight - rows).norm() > 0.5 * rows.norm()


def test_init_std_draws_a_fresh_drafters_layers_from_a_normal(chat_target, data_file, tmp_path):
    stds = {}
    for init_std in (0.0, 0.2):
        out = tmp_path / f"std-{init_std}"
        stage.run(options(chat_target, data_file, out, init_std=init_std, lr=1e-7, lm_head_init="random"))
        drafter = Eagle3Drafter.from_pretrained(out)
        stds[init_std] = {name: float(p.std()) for name, p in drafter.named_parameters() if p.dim() == 2 and name != "embed_tokens.weight"}
    assert all(abs(std - 0.2) < 0.02 for std in stds[0.2].values()), stds[0.2]
    assert all(std < 0.15 for std in stds[0.0].values()), stds[0.0]  # torch's default: 1/sqrt(3 fan_in)
    for bad in (dict(init_std=-0.1), dict(init_std=0.02, init_from=str(tmp_path / "std-0.0"))):
        with pytest.raises(EaglekitError, match="init_std"):
            stage.run(options(chat_target, data_file, tmp_path / "bad", **bad))


def test_seed_leaves_the_validation_split_to_split_seed(chat_target, data_file, tmp_path):
    import contextlib

    from eaglekit.training.setup import setup
    from eaglekit.training.loop import Trainer, setup_distributed

    def split(**extra):
        config = options(chat_target, data_file, tmp_path / "run", **extra)
        with contextlib.ExitStack() as stack:
            d = setup_distributed("cpu")
            trainer = Trainer(config, d, *setup(config, d, stack))
            return trainer.val_idx, float(trainer.drafter.fc.weight.sum())

    (val, fc), (val_seed, fc_seed), (val_split, _) = split(), split(seed=1), split(split_seed=1)
    assert val == val_seed and fc != fc_seed  # another seed: other weights, the same validation records
    assert val != val_split


def test_token_step_weighting_weighs_every_token_the_same(chat_target, data_file, tmp_path):
    """step_weighting=tokens: two one-record steps give twice the gradient of one equal-weighted step over both
    records (what packed training does); with equal weighting the short record would count as much as the long one."""
    import contextlib

    from eaglekit.training.data import mean_mask_counts
    from eaglekit.training.setup import setup
    from eaglekit.training.loop import Trainer, setup_distributed

    config = options(chat_target, data_file, tmp_path / "run", step_weighting="tokens", batch_size=1, draft_vocab_size=10**6)
    with contextlib.ExitStack() as stack:
        d = setup_distributed("cpu")
        drafter, source, identity = setup(config, d, stack)
        assert bool(drafter.t2d.all())  # the whole vocabulary: every position's label is in it, train mask = accuracy mask
        trainer = Trainer(config, d, drafter, source, identity)
        a, b = sorted(trainer.train_idx, key=lambda i: source.lengths[i])[:: len(trainer.train_idx) - 1]  # shortest, longest
        assert source.lengths[a] < source.lengths[b]
        params = [p for p in drafter.parameters() if p.requires_grad]

        def gradient(batches):
            trainer.optimizer.zero_grad(set_to_none=True)
            for batch in batches:
                trainer._micro(batch, 1.0, True)
            return torch.cat([p.grad.flatten() for p in params])

        trainer.record_counts = mean_mask_counts(source.tokens, [a, b], config.max_length, config.ttt_steps)
        per_token = gradient([[a], [b]])
        trainer.record_counts = None
        pooled = gradient([[a, b]])
        assert torch.allclose(per_token, 2 * pooled, rtol=1e-4, atol=1e-7)
        assert not torch.allclose(gradient([[a], [b]]), 2 * pooled, rtol=1e-2)  # equal weighting: not the pooled gradient
