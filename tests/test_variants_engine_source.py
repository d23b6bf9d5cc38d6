"""The engines' own loaders read the drafter-variant flags and tensors where eaglekit's export writes them, and
feed back the hidden state eaglekit's `Eagle3Drafter.head` feeds back (read from the real sources, not imported):
vLLM 0.32.0 from its venv (engine marker), SGLang 0.5.23 from its wheel (network marker, cached wheel)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import engines


def flat(text: str) -> str:
    return " ".join(text.replace("'", '"').split())


@pytest.mark.engine
def test_vllm_reads_the_variant_flags_and_feeds_back_the_post_norm_state():
    root = subprocess.run([engines.vllm_python(), "-c", "import vllm, os; print(os.path.dirname(vllm.__file__))"],
                          capture_output=True, text=True, timeout=300).stdout.strip().splitlines()[-1]
    model = flat((Path(root) / "model_executor/models/llama_eagle3.py").read_text())
    assert 'eagle_config.get( "norm_before_fc", getattr(self.config, "norm_before_fc", False) )' in model
    assert 'getattr(self.config, "fc_norm", False)' in model and 'getattr(self.config, "norm_output", False)' in model
    assert "self.input_norm: RMSNorm | None = RMSNorm( self.fc_input_size," in model  # input_norm.weight [k*H_t]
    per_chunk = "RMSNorm(target_hidden_size, eps=self.config.rms_norm_eps) for _ in range(self.num_aux_hidden_states)"
    assert per_chunk in model  # fc_norm.{i}.weight [H_t]
    assert "aux_output = hidden_states if self.norm_output else hidden_prenorm" in model  # (logits' input, fed back)
    assert 'orig_to_new_substr["input_norm."] = None' in model  # without the flag the tensor is dropped silently
    proposer = flat((Path(root) / "v1/spec_decode/llm_base_proposer.py").read_text())
    assert "last_hidden_states, hidden_states = ret_hidden_states" in proposer  # the second output is fed back
    speculators = flat((Path(root) / "transformers_utils/configs/speculators/algos.py").read_text())
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
        assert f'pre_trained_config["{flag}"] = config_dict.get("{flag}", False)' in speculators, flag


@pytest.mark.network
def test_sglang_reads_the_variant_flags_and_feeds_back_the_post_norm_state():
    from eaglekit.doctor.source import open_source
    from test_doctor_real_engines import SGLANG, wheel

    loader = flat(open_source("sglang", wheel(*SGLANG)).read("sglang/srt/models/llama_eagle3.py"))
    assert 'eagle_config.get("norm_before_fc", getattr(config, "norm_before_fc", False))' in loader
    assert 'getattr(config, "fc_norm", None) or getattr( config, "use_aux_norm", False )' in loader
    assert 'self.norm_output = getattr(config, "norm_output", False)' in loader
    assert "self.input_norm = RMSNorm( self.hidden_size_in * self.num_aux_hidden_states," in loader
    assert '"aux_norm_low": "fc_norm.0"' in loader  # the legacy names eaglekit's import maps too
    assert "aux = hidden_states_to_logits if self.norm_output else hidden_states_to_aux" in loader
