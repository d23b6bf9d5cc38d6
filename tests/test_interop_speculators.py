"""The speculators export loads in the REAL `speculators` package (PyPI) and gives the same logits.

speculators is not an eaglekit dependency. The test runs only where it is installed
(`pip install speculators --no-deps`); its import pulls modules the drafter never uses (openai,
datasets, hs_connectors, loguru), which the loader script stubs when they are missing. It runs in a
subprocess so that nothing it imports or stubs leaks into other tests.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eaglekit.drafters.eagle3.convert import export_drafter
from test_interop_formats import make_drafter

LOADER = r'''
import sys
from unittest import mock

def import_speculators():
    """Import speculators' eagle3 model, stubbing missing modules that only its training/data code needs."""
    stubbed = []
    for _ in range(30):
        try:
            from speculators.models.eagle3 import Eagle3DraftModel
            import speculators.utils.loading  # imported lazily by from_pretrained
            return Eagle3DraftModel, stubbed
        except ModuleNotFoundError as error:
            name = error.name or ""
            if not name or name.startswith(("speculators", "torch", "transformers", "pydantic")) or name in sys.modules:
                print(f"SKIP: speculators cannot be imported here: {error}")
                sys.exit(0)
            stub = mock.MagicMock(name=name)
            stub.__path__, stub.__spec__ = [], None
            sys.modules[name] = stub
            stubbed.append(name)
            for key in [k for k in sys.modules if k.startswith("speculators")]:
                del sys.modules[key]
    print("SKIP: speculators import did not settle")
    sys.exit(0)

import torch
Eagle3DraftModel, stubbed = import_speculators()
model = Eagle3DraftModel.from_pretrained(sys.argv[1]).eval()
for config in (model.config.transformer_layer_config, model.layers[0].self_attn.config):
    config._attn_implementation = "eager"  # the default flex attention needs a block mask; eager takes a float mask
probe = torch.load(sys.argv[2])
with torch.no_grad():
    hidden = model.fc(probe["aux"])
    x = torch.cat([model.embed_tokens(probe["ids"]), hidden], dim=-1)
    T = probe["ids"].shape[1]
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    out = model.layers[0](x, attention_mask=mask, position_ids=probe["pos"],
                          position_embeddings=model.rotary_emb(x, probe["pos"]))
    out = out[0] if isinstance(out, tuple) else out
    logits = model.lm_head(model.norm(out))
torch.save({"logits": logits, "d2t": model.d2t, "t2d": model.t2d,
            "ids": list(model.config.eagle_aux_hidden_state_layer_ids), "stubbed": stubbed}, sys.argv[3])
print("OK")
'''


@pytest.mark.skipif(importlib.util.find_spec("speculators") is None,
                    reason="speculators is not installed (pip install speculators --no-deps to run this test)")
def test_speculators_export_loads_in_speculators(tmp_path):
    verifier = tmp_path / "verifier"  # speculators loads the verifier's config (and embedding) at from_pretrained
    LlamaForCausalLM(LlamaConfig(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(verifier)
    drafter = make_drafter(target_name_or_path=str(verifier))
    export_drafter(drafter, tmp_path / "spec", "speculators")
    generator = torch.Generator().manual_seed(1)
    probe = {"aux": torch.randn(1, 6, 96, generator=generator), "ids": torch.randint(0, 120, (1, 6), generator=generator),
             "pos": torch.arange(6)[None]}
    torch.save(probe, tmp_path / "probe.pt")
    (tmp_path / "loader.py").write_text(LOADER)
    result = subprocess.run([sys.executable, str(tmp_path / "loader.py"), str(tmp_path / "spec"), str(tmp_path / "probe.pt"),
                             str(tmp_path / "out.pt")], capture_output=True, text=True, timeout=600)
    if result.stdout.startswith("SKIP:"):
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        _, expected, _ = drafter(drafter.fuse(probe["aux"]), probe["ids"], probe["pos"], mask=mask)
    assert torch.allclose(out["logits"], expected, atol=1e-5), (out["logits"] - expected).abs().max()
    assert torch.equal(out["d2t"], drafter.d2t) and torch.equal(out["t2d"], drafter.t2d)
    assert out["ids"] == [2, 4, 5]
