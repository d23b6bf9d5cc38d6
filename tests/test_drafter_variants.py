"""Drafter variants (norm_before_fc; EAGLE 3.1 = fc_norm + norm_output): the semantics vLLM's llama_eagle3.py
gives them, TTT's efficient path against the hand-written reference per variant, save/load, and decoding
(static fast path equal to the eager reference, tokens equal to the target's greedy output)."""

from __future__ import annotations

import pytest
import torch

from builders import VOCAB, both_ttt_paths, tiny_target
from eaglekit.decode import generate
from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
from eaglekit.drafters.eagle3.ttt import naive_ttt_forward, reference_fuse, reference_step
from eaglekit.training.objective import soft_labels
from eaglekit.errors import EaglekitError
from eaglekit.targets.capture import default_aux_layers

VARIANTS = {
    "norm_before_fc": {"norm_before_fc": True},
    "fc_norm": {"fc_norm": True},
    "norm_output": {"norm_output": True},
    "eagle3.1": {"fc_norm": True, "norm_output": True},
}
PROMPT = [5, 17, 33, 2, 9, 41]


def variant_config(target_hidden: int = 16, aux=(1, 2, 3), **flags) -> DrafterConfig:
    return DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=VOCAB, draft_vocab_size=48, target_hidden_size=target_hidden, aux_layer_ids=aux,
                         target_num_layers=8, **flags)


def randomized(drafter: Eagle3Drafter, seed: int = 0) -> Eagle3Drafter:
    """Random weights everywhere, norms included (weights 1 would hide a norm applied to the wrong tensor)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name == "embed_tokens.weight" or p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
            else:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=generator))
    drafter.set_vocab_mapping(torch.arange(0, 96, 2))
    return drafter


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_fc_norm_and_norm_before_fc_are_exclusive():
    with pytest.raises(EaglekitError, match="mutually exclusive"):
        variant_config(norm_before_fc=True, fc_norm=True)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_tensors_and_semantics(name):
    """Tensor names and shapes as the engines load them; fuse and the fed-back hidden state as vLLM computes
    them: input_norm over the 3*H_t concatenation, fc_norm per aux chunk, norm_output feeds norm(h) back."""
    flags = VARIANTS[name]
    drafter = randomized(Eagle3Drafter(variant_config(**flags)))
    shapes = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    assert (shapes.get("input_norm.weight") == (48,)) == bool(flags.get("norm_before_fc"))
    chunk_norms = [shapes.get(f"fc_norm.{i}.weight") for i in range(3)]
    assert chunk_norms == ([(16,)] * 3 if flags.get("fc_norm") else [None] * 3)
    aux = torch.randn(2, 5, 48)
    w = drafter.fc.weight
    if flags.get("norm_before_fc"):
        expected = rms(aux, drafter.input_norm.weight) @ w.T
    elif flags.get("fc_norm"):
        expected = torch.cat([rms(c, n.weight) for c, n in zip(aux.split(16, -1), drafter.fc_norm)], -1) @ w.T
    else:
        expected = aux @ w.T
    assert torch.allclose(drafter.fuse(aux), expected, atol=1e-5)
    assert not torch.allclose(drafter.fuse(aux), aux @ w.T, atol=1e-3) or name == "norm_output"
    plain = Eagle3Drafter(variant_config())  # the same weights without norm_output: h before the final norm
    shared = {k: v for k, v in drafter.state_dict().items() if not k.startswith(("input_norm", "fc_norm"))}
    plain.load_state_dict(shared)
    hidden, ids, pos = torch.randn(1, 5, 32), torch.randint(0, VOCAB, (1, 5)), torch.arange(5)[None]
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    out, logits, _ = drafter(hidden, ids, pos, None, mask)
    plain_out, plain_logits, _ = plain(hidden, ids, pos, None, mask)
    assert torch.allclose(logits, plain_logits, atol=1e-5)  # the lm_head always reads norm(h)
    fed_back = rms(plain_out, drafter.norm.weight) if flags.get("norm_output") else plain_out
    assert torch.allclose(out, fed_back, atol=1e-5)
    ref_out, ref_logits, _ = reference_step(drafter, hidden, ids, pos, [])
    assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(logits, ref_logits, atol=1e-5)
    assert torch.allclose(reference_fuse(drafter, aux), drafter.fuse(aux), atol=1e-5)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_efficient_ttt_matches_naive_per_variant(name):
    drafter = randomized(Eagle3Drafter(variant_config(**VARIANTS[name]))).double()
    torch.manual_seed(3)
    b, t = 2, 10
    ids = torch.randint(0, VOCAB, (b, t))
    loss_mask = torch.rand(b, t) > 0.3
    aux = torch.randn(b, t, 48, dtype=torch.float64)
    probs, in_vocab = soft_labels(torch.randn(b, t, VOCAB) * 3, drafter.t2d)
    probs = probs.double()
    fast, slow, grads = both_ttt_paths(drafter, aux, ids, loss_mask, probs, in_vocab, num_steps=4)
    assert torch.allclose(fast.loss_sums, slow.loss_sums, rtol=1e-9, atol=1e-9)
    assert torch.equal(fast.correct, slow.correct)
    norms = [n for n in grads if n.startswith(("input_norm", "fc_norm"))]
    assert len(norms) == {"norm_before_fc": 1, "fc_norm": 3, "eagle3.1": 3}.get(name, 0)  # the new norms train
    for n, grad in grads.items():
        assert torch.allclose(grad, dict(drafter.named_parameters())[n].grad, rtol=1e-9, atol=1e-12), n
    # norm_output changes what later steps see: the loss of steps >= 1 differs from the same weights without it
    if name == "norm_output":
        plain = Eagle3Drafter(variant_config()).double()
        plain.load_state_dict(drafter.state_dict())
        other = naive_ttt_forward(plain, aux, ids, loss_mask, probs, in_vocab, num_steps=4)
        assert torch.allclose(other.loss_sums[0], slow.loss_sums[0])
        assert not torch.allclose(other.loss_sums[1:], slow.loss_sums[1:])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_save_and_load_keep_the_variant(name, tmp_path):
    drafter = randomized(Eagle3Drafter(variant_config(**VARIANTS[name])))
    drafter.save_pretrained(tmp_path)
    loaded = Eagle3Drafter.from_pretrained(tmp_path)
    assert loaded.config == drafter.config
    for key, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key


def variant_drafter(target, **flags) -> Eagle3Drafter:
    layers = target.config.num_hidden_layers
    config = variant_config(target.config.hidden_size, default_aux_layers(layers), **flags)
    drafter = randomized(Eagle3Drafter(config), seed=1)
    drafter.load_target_embedding(target.get_input_embeddings().weight)
    return drafter.eval()


@pytest.fixture(scope="module")
def llama():
    target = tiny_target("llama")
    out = target.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, pad_token_id=0,
                          attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long))
    return target, out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("name", ["norm_before_fc", "eagle3.1"])  # eagle3.1 = fc_norm and norm_output together
def test_decode_static_equals_eager_per_variant(name, llama):
    target, reference = llama
    drafter = variant_drafter(target, **VARIANTS[name])
    for kwargs in (dict(method="chain", chain_length=3), dict(method="tree", depth=3, tree_top_k=3, total_tokens=8),
                   dict(method="tree", depth=3, tree_top_k=3, total_tokens=8, temperature=1.0, seed=2)):
        eager = generate(target, drafter, PROMPT, 16, backend="eager", **kwargs)
        fast = generate(target, drafter, PROMPT, 16, backend="static", **kwargs)
        assert (fast.tokens, fast.stats.accepted) == (eager.tokens, eager.stats.accepted), kwargs
        if kwargs.get("temperature", 0) == 0:
            assert eager.tokens == reference, kwargs


def test_static_drafter_step_follows_norm_output(llama):
    """The static drafter step hands the next step the same hidden state as `Eagle3Drafter.forward`."""
    from eaglekit.drafters.eagle3.static import StaticDrafter

    target, _ = llama
    for flags in ({}, {"norm_output": True}):
        drafter = variant_drafter(target, **flags)
        static = StaticDrafter(drafter, 32, 4)
        aux = torch.randn(5, 3 * target.config.hidden_size)
        ids, pos = torch.randint(0, VOCAB, (5,)), torch.arange(5)
        with torch.inference_mode():
            hidden, logits = static.extend(aux, ids, pos)
            mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
            ref_hidden, ref_logits, _ = drafter(drafter.fuse(aux[None]), ids[None], pos[None], None, mask)
        assert torch.allclose(hidden, ref_hidden[0], atol=1e-5) and torch.allclose(logits, ref_logits[0], atol=1e-5)


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_export_and_import_keep_the_variant(fmt, name, tmp_path):
    """Each engine layout holds the variant's flags where that engine reads them and its norm tensors under the
    engines' names; import reads them back with the same numbers (and the vocabulary mapping)."""
    import json

    from safetensors.torch import load_file

    from eaglekit.drafters.eagle3 import formats
    from eaglekit.drafters.eagle3.convert import export_drafter, import_checkpoint

    flags = VARIANTS[name]
    drafter = randomized(Eagle3Drafter(variant_config(target_hidden=32, **flags)))
    export_drafter(drafter, tmp_path, fmt)
    data = json.loads((tmp_path / "config.json").read_text())
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for flag in formats.VARIANT_FLAGS:
        assert data[flag] is bool(flags.get(flag)), flag  # top level: where vLLM, SGLang and speculators read it
    if fmt != "speculators":
        assert data["eagle_config"].get("norm_before_fc", False) is bool(flags.get("norm_before_fc"))
    norms = formats.variant_tensors(drafter.config)
    assert set(norms) <= set(tensors) and set(norms) <= set(formats.required_keys(fmt, drafter.config))
    assert len(norms) == {"norm_before_fc": 1, "fc_norm": 3, "eagle3.1": 3}.get(name, 0)
    back = import_checkpoint(tmp_path, from_format=fmt)
    assert all(getattr(back.config, flag) == getattr(drafter.config, flag) for flag in formats.VARIANT_FLAGS)
    for key, tensor in drafter.state_dict().items():
        assert torch.equal(back.state_dict()[key], tensor), key
    if norms:  # the exporter's key check: a checkpoint without the variant's norms is refused
        state = formats.to_checkpoint_state({k: v for k, v in drafter.state_dict().items() if k not in norms}, fmt)
        with pytest.raises(EaglekitError, match=norms[0].replace(".", r"\.")):
            formats.check_required(fmt, drafter.config, state)


def test_import_reads_sglang_legacy_fc_norm_names(tmp_path):
    """SGLang's `use_aux_norm` flag and `aux_norm_{low,mid,high}` tensors are fc_norm under older names."""
    import json

    from safetensors.torch import load_file, save_file

    from eaglekit.drafters.eagle3.convert import export_drafter, import_checkpoint

    drafter = randomized(Eagle3Drafter(variant_config(fc_norm=True)))
    export_drafter(drafter, tmp_path, "sglang")
    data = json.loads((tmp_path / "config.json").read_text())
    del data["fc_norm"]
    (tmp_path / "config.json").write_text(json.dumps({**data, "use_aux_norm": True}))
    legacy = {"fc_norm.0.weight": "aux_norm_low.weight", "fc_norm.1.weight": "aux_norm_mid.weight",
              "fc_norm.2.weight": "aux_norm_high.weight"}
    tensors = load_file(str(tmp_path / "model.safetensors"))
    save_file({legacy.get(k, k): v for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    back = import_checkpoint(tmp_path, from_format="sglang")
    assert back.config.fc_norm and torch.equal(back.fc_norm[2].weight, drafter.fc_norm[2].weight)


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    import json
    import random

    rng, words = random.Random(0), "the quick brown fox jumps over the lazy dog hello world".split()
    path = tmp_path_factory.mktemp("variant_data") / "chat.jsonl"
    with open(path, "w") as handle:
        for i in range(12):
            messages = [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(4))},
                        {"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(8))}]
            handle.write(json.dumps({"id": f"r{i}", "messages": messages}) + "\n")
    return str(path)


def test_train_options_build_and_keep_the_variant(chat_target, chat_data, tmp_path):
    """`eaglekit train fc_norm=true norm_output=true` trains an EAGLE 3.1 drafter (its norms learn); fine-tuning it
    keeps the variant; asking a drafter for a variant it lacks, or for both fc norms, is refused."""
    from eaglekit.config import load_config
    from eaglekit.stages import train as stage

    def options(out, **extra):
        base = {"target": chat_target, "data": [chat_data], "output": str(tmp_path / out), "batch_size": 4,
                "ttt_steps": 2, "draft_vocab_size": 48, "val_fraction": 0.2, "lr": 1e-2, "warmup_steps": 0,
                "max_steps": 2}
        return load_config(stage.Config, overrides={**base, **extra})

    stage.run(options("v31", fc_norm=True, norm_output=True))
    drafter = Eagle3Drafter.from_pretrained(tmp_path / "v31")
    assert drafter.config.fc_norm and drafter.config.norm_output and not drafter.config.norm_before_fc
    assert not torch.equal(drafter.fc_norm[0].weight, torch.ones_like(drafter.fc_norm[0].weight))  # trained
    stage.run(options("tuned", init_from=str(tmp_path / "v31"), max_steps=1))
    tuned = Eagle3Drafter.from_pretrained(tmp_path / "tuned")
    assert tuned.config.fc_norm and tuned.config.norm_output
    from eaglekit.drafters.eagle3.convert import export_drafter

    export_drafter(drafter, tmp_path / "v31-vllm", "vllm")  # fine-tuning a published (vLLM-layout) EAGLE 3.1 drafter
    stage.run(options("tuned-vllm", init_from=str(tmp_path / "v31-vllm"), max_steps=1, draft_vocab_size=32))
    from_engine = Eagle3Drafter.from_pretrained(tmp_path / "tuned-vllm")
    assert from_engine.config.fc_norm and from_engine.config.norm_output
    assert torch.equal(from_engine.d2t, drafter.d2t)  # its vocabulary mapping kept, not rebuilt from the data
    with pytest.raises(EaglekitError, match="norm_before_fc=true: init_from"):
        stage.run(options("bad", init_from=str(tmp_path / "v31"), norm_before_fc=True))
    with pytest.raises(EaglekitError, match="mutually exclusive"):
        stage.run(options("both", fc_norm=True, norm_before_fc=True))


def test_compiled_fused_step_traces_eagle3_1(llama, monkeypatch):
    """The fused step with an EAGLE 3.1 drafter traces as one whole graph (dynamo, aot_eager on the CPU) and gives
    the eager reference's tokens and acceptance."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from eaglekit.decode import Decoder, graphs

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(graphs, "COMPILE_OPTIONS", {"backend": counter, "fullgraph": True, "dynamic": False})
    monkeypatch.setattr(graphs, "PREFILL_OPTIONS", {"backend": "aot_eager", "fullgraph": True, "dynamic": None})
    target, reference = llama
    drafter = variant_drafter(target, fc_norm=True, norm_output=True)
    options = dict(method="tree", depth=3, tree_top_k=3, total_tokens=8)
    fast = Decoder(target, drafter, backend="static", compile=True, max_length=128).generate(PROMPT, 16, **options)
    eager = generate(target, drafter, PROMPT, 16, backend="eager", **options)
    assert (fast.tokens, fast.stats.accepted) == (eager.tokens, eager.stats.accepted) and fast.tokens == reference
    assert counter.frame_count == 1  # the whole speculative step, norms included, is one graph
