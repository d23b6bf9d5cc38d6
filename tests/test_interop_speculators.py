"""The speculators export loads in the REAL `speculators` package (PyPI, 0.9.0) and gives the same logits.

speculators is not an eaglekit dependency: the loader script runs in speculators' own venv (`make
speculators-env`, as `make test` builds it; EAGLEKIT_SPECULATORS_PYTHON names another), as the other speculators
tests do, and skips (fails under CI) with the command that builds it when it is missing. Where speculators was
installed without its dependencies (`pip install speculators --no-deps`), the modules its import pulls that the
drafter never uses (openai, datasets, hs_connectors, loguru) are stubbed by the loader.
"""

from __future__ import annotations

import subprocess

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import engines
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
                sys.exit(f"speculators cannot be imported here: {error}")
            stub = mock.MagicMock(name=name)
            stub.__path__, stub.__spec__ = [], None
            sys.modules[name] = stub
            stubbed.append(name)
            for key in [k for k in sys.modules if k.startswith("speculators")]:
                del sys.modules[key]
    sys.exit("speculators import did not settle")

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


@pytest.mark.engine
def test_speculators_export_loads_in_speculators(tmp_path):
    python = engines.speculators_python()  # skips (fails under CI) naming `make speculators-env` when not built
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
    result = subprocess.run([python, str(tmp_path / "loader.py"), str(tmp_path / "spec"), str(tmp_path / "probe.pt"),
                             str(tmp_path / "out.pt")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), \
        result.stdout[-1000:] + result.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        _, expected, _ = drafter(drafter.fuse(probe["aux"]), probe["ids"], probe["pos"], mask=mask)
    assert torch.allclose(out["logits"], expected, atol=1e-5), (out["logits"] - expected).abs().max()
    assert torch.equal(out["d2t"], drafter.d2t) and torch.equal(out["t2d"], drafter.t2d)
    assert out["ids"] == [2, 4, 5]
