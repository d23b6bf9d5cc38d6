"""Hidden states captured by vLLM (`eaglekit extract backend=vllm`): the engine's layers, its job, and the files it
writes streamed into eaglekit's ONE store format (the shard writer of `eaglekit.targets.extract`).

vLLM runs in its own Python (`vllm_capture_worker.py`, started by `vllm_engine.started`) with the
`extract_hidden_states` method: every finished request leaves one safetensors file of `[T, n_ids, H]` states of
the layers asked for (input-of-layer ids, returned in layer order). eaglekit asks for the distinct sorted aux ids
plus id L (the last layer's output before the final norm), stores the aux ids in their own order and the final
state as the target's own final norm (its Hugging Face module and checkpoint weight) applied to id L. Each file is
checked (token ids equal to those sent), copied into the shard buffer and deleted; a re-run resumes after the last
logged shard like `backend=hf`. Regenerate-and-capture: a generation request (greedy by default, nothing saved)
is followed by a capture request of the record that eaglekit tokenises from the answer; vLLM's prefix cache holds
the generation's states, so the capture request recomputes only the template's tail after the answer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from eaglekit.errors import EaglekitError
from eaglekit.vllm import engine as ve
from eaglekit.vllm.workers.vllm_worker_common import JsonlTail

if TYPE_CHECKING:
    import torch

    from eaglekit.targets.extract import Record
    from eaglekit.targets.shard_writer import ShardWriter
    from eaglekit.targets.store import StoreLayout

log = logging.getLogger(__name__)

WORKER = Path(__file__).parent / "workers" / "vllm_capture_worker.py"
SPOOL = ".vllm-spool"
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "fp32": "float32",
          "float32": "float32"}

# ---- which layers the engine captures (pure) -----------------------------------------------------

@dataclass(frozen=True)
class EngineLayers:
    """What vLLM is asked for and where the store's tensors come from in its `[T, n_ids, H]` rows."""

    ids: tuple[int, ...]  # distinct, ascending (vLLM returns them in layer order), input_of_layer, ends with L
    aux_index: tuple[int, ...]  # row of each aux id, in the store's order
    final_index: int  # row of id L, to which the final norm is applied


def engine_layers(aux_ids: tuple[int, ...], num_layers: int, mla: bool = False) -> EngineLayers:
    """The ids vLLM captures for `aux_ids` (input_of_layer) and the final state; refuses what vLLM cannot capture."""
    if not all(0 <= i <= num_layers for i in aux_ids):
        raise EaglekitError(f"aux_layer_ids {list(aux_ids)} (input_of_layer) must lie in 0..{num_layers} for this "
                            f"{num_layers}-layer target; omit them for the default")
    if mla and 0 in aux_ids:
        raise EaglekitError("aux layer id 0 (the embedding output) cannot be captured by vLLM on this MLA target "
                            "(its DeepSeek decoder has no residual state before the first layer); choose ids >= 1, "
                            "or use backend=hf")
    ids = tuple(sorted({*aux_ids, num_layers}))  # vLLM fails on repeated ids: each layer is asked for once
    return EngineLayers(ids, tuple(ids.index(i) for i in aux_ids), ids.index(num_layers))


def engine_dtype(model_dtype: str, mla: bool, device_type: str) -> str:
    """The engine's dtype: auto = fp32 on the CPU (bf16 for MLA targets: the CPU build runs them in bf16 only), the
    checkpoint's own on GPUs."""
    if model_dtype in ("", "auto"):
        return ("bfloat16" if mla else "float32") if device_type == "cpu" else "auto"
    if model_dtype not in DTYPES:
        raise EaglekitError(f"model_dtype={model_dtype}: choose auto, bf16, fp16 or fp32")
    return DTYPES[model_dtype]


def cpu_thread_binding(tensor_parallel_size: int, cores: list[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `tensor_parallel_size` CPU ranks: the allowed cores split into one list per
    rank ("0|1" for two ranks on cores 0 and 1)."""
    if len(cores) < tensor_parallel_size:
        raise EaglekitError(f"tensor_parallel_size={tensor_parallel_size} on the CPU needs a core per rank; this "
                            f"process may use {len(cores)}")
    share = len(cores) // tensor_parallel_size
    return "|".join(",".join(str(c) for c in cores[r * share:(r + 1) * share]) for r in range(tensor_parallel_size))


def engine_error(text: str, target: str, engine: ve.Engine, report: dict[str, Any] | None = None) -> str:
    """The one-line fix for an engine failure whose text vLLM wrote; a class without the EAGLE-3 interface gets the
    doctor's own advice on this engine's vLLM (`report`: the doctor's, when already known)."""
    if "does not support EAGLE3 interface" in text:
        from eaglekit.vllm.support import doctor_advice

        return ("vLLM refuses to capture hidden states from this target class (no EAGLE-3 interface): "
                f"{doctor_advice(engine, target, report)}, then re-run")
    if "are not supported for now" in text or "not supported by vLLM" in text or "Cannot find model module" in text:
        return (f"vLLM does not know the target's architecture ({text[-300:]}); use a model class vLLM serves, or "
                "backend=hf")
    if "max_model_len" in text or "longer than the maximum model length" in text:
        return f"a request is longer than vLLM's max_model_len ({text[-300:]}); lower max_length or raise max_model_len"
    return text[-600:]


# ---- the target's final norm, applied to id L -------------------------------------------------------

def _checkpoint_keys(directory: Path) -> list[str]:
    """Every tensor name of the checkpoint (its index when there is one, else the safetensors headers)."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    keys: list[str] = []
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            keys += list(handle.keys())
    return keys


def _checkpoint_tensors(directory: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors of `names` from the checkpoint's safetensors files (nothing else is read)."""
    from safetensors import safe_open

    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in set(handle.keys()) & set(names):
                found[name] = handle.get_tensor(name)
    return found


def _norm_prefix(path: str, keys: list[str]) -> str:
    """The checkpoint's name of the final norm module: its module path, else the one text-decoder key that ends like
    it (a wrapper may store its language model under another prefix)."""
    if f"{path}.weight" in keys:
        return path
    tail = "." + path.rsplit(".", 1)[-1] + ".weight"
    found = [k[: -len(".weight")] for k in keys if k.endswith(tail) and ".layers." not in k
             and not k.startswith(("vision", "visual", "audio"))]
    if len(found) != 1:
        raise EaglekitError(f"cannot find the final norm ({path}) among the checkpoint's tensors (candidates: "
                            f"{found or 'none'}); use backend=hf")
    return found[0]


def final_norm(target_dir: str, config: Any, trust_remote_code: bool = False) -> torch.nn.Module:
    """The target's final norm with its checkpoint weights: the Hugging Face module (built on the meta device,
    located as `backend=hf` locates it), or an RMSNorm of the text config's eps for a class transformers lacks."""
    import torch

    from eaglekit.targets.capture import find_decoder, text_config

    directory = Path(target_dir)
    module, path = None, "model.norm"
    for auto in _auto_classes():
        with contextlib.suppress(ValueError), torch.device("meta"):
            stack = find_decoder(auto.from_config(config, trust_remote_code=trust_remote_code))
            if stack.norm is not None and stack.norm_path:
                module, path = stack.norm, stack.norm_path
            break
    prefix = _norm_prefix(path, _checkpoint_keys(directory))
    names = list(module.state_dict()) if module is not None else ["weight"]
    tensors = _checkpoint_tensors(directory, [f"{prefix}.{name}" for name in names])
    if len(tensors) != len(names):
        raise EaglekitError(f"the checkpoint in {directory} lacks some of {prefix}'s tensors ({names}); use backend=hf")
    state = {name: tensors[f"{prefix}.{name}"] for name in names}
    if module is None:
        text = text_config(config)
        return RMSNorm(state["weight"], float(getattr(text, "rms_norm_eps", None) or 1e-6))
    module = module.to_empty(device="cpu")
    module.load_state_dict(state)
    return module.eval().requires_grad_(False)


def _auto_classes() -> tuple[Any, ...]:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForCausalLM, AutoModelForImageTextToText


def _rms_norm_module() -> type:
    import torch

    class _RMSNorm(torch.nn.Module):
        """x / rms(x) * weight in fp32, returned in the input dtype (what Llama/DeepSeek decoders compute)."""

        def __init__(self, weight: torch.Tensor, eps: float):
            super().__init__()
            self.weight, self.eps = torch.nn.Parameter(weight, requires_grad=False), eps

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * x32.to(x.dtype)

    return _RMSNorm


def RMSNorm(weight: Any, eps: float) -> Any:  # noqa: N802 - a class made when torch is imported
    return _rms_norm_module()(weight, eps)


# ---- the engine process -----------------------------------------------------------------------------

@dataclass(frozen=True)
class EngineOptions:
    python: str = ""
    version_check: bool = True
    tensor_parallel_size: int = 1
    model_dtype: str = "auto"
    engine_args: dict[str, Any] = field(default_factory=dict)
    max_in_flight: int = 64
    max_spool: int = 128


def engine_arguments(engine: ve.Engine, target_dir: str, options: EngineOptions, max_model_len: int,
                     prefix_caching: bool) -> dict[str, Any]:
    facts = ve.target_facts(target_dir)
    args = ve.engine_args(max_model_len, target_dir, engine.device_type)
    if engine.device_type != "cpu":
        args.pop("enforce_eager")  # CUDA graphs and compilation stay on where they exist
    args.update(dtype=engine_dtype(options.model_dtype, facts["mla"], engine.device_type),
                enable_prefix_caching=prefix_caching, tensor_parallel_size=options.tensor_parallel_size)
    args.update(options.engine_args)
    return args


def engine_environment(engine: ve.Engine, tensor_parallel_size: int) -> dict[str, str]:
    """PYTHONPATH for the connector module; on the CPU one core list per tensor-parallel rank."""
    path = os.pathsep.join(p for p in (str(WORKER.parent), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path}
    if engine.device_type == "cpu" and tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [*range(os.cpu_count() or 1)]
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(tensor_parallel_size, cores)
    return env


class EngineSession:
    """The worker process and its two spool files; `events()` yields what it reports, raising on its failure."""

    def __init__(self, process: subprocess.Popen, spool: Path, log_path: Path, target: str, engine: ve.Engine):
        self.process, self.spool, self.log_path, self.target, self.engine = process, spool, log_path, target, engine
        self.requests = open(spool / "requests.jsonl", "a")
        self.events_file = JsonlTail(spool / "events.jsonl")
        self.ready: dict[str, Any] = {}
        self.ready_at = 0.0  # perf_counter when the engine reported it was up
        self.done: dict[str, Any] = {}

    def send(self, request: dict[str, Any]) -> None:
        self.requests.write(json.dumps(request) + "\n")
        self.requests.flush()

    def events(self) -> Iterator[dict[str, Any]]:
        while not self.done:
            found = self.events_file.read()
            if not found:
                if self.process.poll() is not None:
                    found = self.events_file.read()  # written just before it exited
                    if not found:
                        raise self.failure("exited")
                time.sleep(0.02)
            for event in found:
                if event.get("event") == "failed":
                    raise self.failure("failed", event["error"])
                if event.get("event") == "ready":
                    self.ready, self.ready_at = event, time.perf_counter()
                elif event.get("event") == "done":
                    self.done = event
                else:
                    yield event

    def failure(self, how: str, text: str = "") -> EaglekitError:
        text = text or ve.log_tail(self.log_path, 12)
        advice = engine_error(text, self.target, self.engine)
        return EaglekitError(f"the vLLM capture engine {how} (log {self.log_path}): {advice}")


@contextlib.contextmanager
def engine_session(engine: ve.Engine, job: dict[str, Any], spool: Path, target: str, env: dict[str, str],
                   log_path: Path) -> Iterator[EngineSession]:
    """The worker started on `job`; stopped by its process group when the block ends (a tensor-parallel engine's own
    shutdown may not end: it is not waited for)."""
    import shutil

    from eaglekit.manifest import atomic_write_json

    shutil.rmtree(spool, ignore_errors=True)
    spool.mkdir(parents=True)
    atomic_write_json(spool / "job.json", {**job, "spool": str(spool)})
    log_path.unlink(missing_ok=True)
    with ve.started([engine.python, str(WORKER), str(spool / "job.json")], log_path, env) as process:
        session = EngineSession(process, spool, log_path, target, engine)
        try:
            yield session
        finally:
            session.requests.close()
    shutil.rmtree(spool, ignore_errors=True)


# ---- from a request's file to the store --------------------------------------------------------------

def read_states(path: str, record: Record, layers: EngineLayers, norm: torch.nn.Module,
                layout: StoreLayout) -> dict[str, torch.Tensor]:
    """One request's file -> the record's (T, .) rows in the storage dtype; its token ids must be the record's."""
    import torch
    from safetensors.torch import load_file

    from eaglekit.targets.extract import storage_rows

    data = load_file(path)
    hidden, token_ids = data["hidden_states"], data["token_ids"]  # (T, n_ids, H), (T,)
    if not torch.equal(token_ids.long(), record.input_ids):
        raise EaglekitError(f"vLLM returned {len(token_ids)} token ids for record {record.id} that differ from the "
                            f"{len(record.input_ids)} sent; the states would belong to other tokens, nothing of it "
                            "is stored (a vLLM version with other prompt handling? report it)")
    if hidden.shape[1:] != (len(layers.ids), layout.hidden_size):
        raise EaglekitError(f"vLLM's states for record {record.id} have shape {list(hidden.shape)}, expected "
                            f"[T, {len(layers.ids)}, {layout.hidden_size}]")
    with torch.inference_mode():
        aux = hidden[:, list(layers.aux_index)].reshape(len(token_ids), -1)  # (T, 3H)
        final = norm.to(hidden.dtype)(hidden[:, layers.final_index])  # (T, H)
    return storage_rows(aux, final, layout)


@dataclass
class CaptureCounters:
    records: int = 0
    tokens: int = 0
    generated_tokens: int = 0
    answers_cut: int = 0  # regenerated answers cut to fit the engine's context
    seconds: float = 0.0
    engine_startup_seconds: float = 0.0
    finish_reasons: dict[str, int] = field(default_factory=dict)


def store_file(path: str, record: Record, layers: EngineLayers, norm: Any, layout: StoreLayout,
               writer: ShardWriter) -> None:
    states = read_states(path, record, layers, norm, layout)
    writer.add_batch([record.id], [record.input_ids], [record.loss_mask], states)
    os.remove(path)


def capture_records(session: EngineSession, records: list[Record], layers: EngineLayers, norm: Any,
                    layout: StoreLayout, writer: ShardWriter, window: int,
                    on_stored: Callable[[Record], None]) -> CaptureCounters:
    """Send every record (at most `window` outstanding), store each file as it comes, in any order."""
    counters = CaptureCounters()
    sent = 0

    def send_more() -> None:
        nonlocal sent
        while sent < len(records) and sent - counters.records < window:
            session.send({"id": sent, "prompt": records[sent].input_ids.tolist(), "max_tokens": 1, "save": True})
            sent += 1
        if sent == len(records):
            session.send({"end": True})
            sent += 1

    send_more()
    for event in session.events():
        record = records[event["id"]]
        if "error" in event:
            advice = engine_error(event["error"], session.target, session.engine)
            raise EaglekitError(f"vLLM refused record {record.id}: {advice}")
        store_file(event["file"], record, layers, norm, layout, writer)
        counters.records += 1
        counters.tokens += len(record.input_ids)
        on_stored(record)
        send_more()
    counters.seconds = time.perf_counter() - session.ready_at
    counters.engine_startup_seconds = session.ready.get("startup_seconds", 0.0)
    return counters
