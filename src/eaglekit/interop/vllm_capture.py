"""Hidden states captured by vLLM (`eaglekit extract backend=vllm`): the engine's layers, its job, and the files it
writes streamed into eaglekit's ONE store format (the shard writer of `eaglekit.target.extract`).

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
from eaglekit.interop import vllm_engine as ve

if TYPE_CHECKING:
    import torch

    from eaglekit.target.extract import Record
    from eaglekit.target.shard_writer import ShardWriter
    from eaglekit.target.store import StoreLayout

log = logging.getLogger(__name__)

WORKER = Path(__file__).with_name("vllm_capture_worker.py")
SPOOL = ".vllm-spool"
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "fp32": "float32",
          "float32": "float32"}
DOCTOR_FIX = ("vLLM refuses to capture hidden states from this target class (no EAGLE-3 interface): run "
              "`eaglekit doctor --engine vllm --target TARGET --fix` and pip-install the plugin it writes into vLLM's "
              "environment, then re-run")


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


def engine_error(text: str, target: str) -> str:
    """The one-line fix for an engine failure whose text vLLM wrote."""
    if "does not support EAGLE3 interface" in text or "image_token_index" in text:
        return DOCTOR_FIX.replace("TARGET", target)
    if "are not supported for now" in text or "not supported by vLLM" in text or "Cannot find model module" in text:
        return (f"vLLM does not know the target's architecture ({text[-300:]}); use a model class vLLM serves, or "
                "backend=hf")
    if "max_model_len" in text or "longer than the maximum model length" in text:
        return f"a request is longer than vLLM's max_model_len ({text[-300:]}); lower max_length or raise max_model_len"
    return text[-600:]


# ---- the target's final norm, applied to id L -------------------------------------------------------

def _checkpoint_tensors(directory: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors of `names` present in the checkpoint's safetensors files (read without loading the rest)."""
    from safetensors import safe_open

    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in set(handle.keys()) & set(names):
                found[name] = handle.get_tensor(name)
    return found


def _norm_keys(path: str, keys: list[str]) -> list[str]:
    """Checkpoint keys of the final norm's weight: its module path, else the one key that ends like it."""
    wanted = f"{path}.weight"
    if wanted in keys:
        return [wanted]
    tail = ".".join(wanted.split(".")[-2:])  # e.g. "norm.weight": a wrapper stores its language model elsewhere
    return [k for k in keys if k.endswith(tail) and ".layers." not in k and not k.startswith(("vision", "visual"))]


def _checkpoint_keys(directory: Path) -> list[str]:
    from safetensors import safe_open

    keys: list[str] = []
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            keys += list(handle.keys())
    return keys


def final_norm(target_dir: str, config: Any, trust_remote_code: bool = False) -> torch.nn.Module:
    """The target's final norm with its checkpoint weight: the Hugging Face module (built on the meta device,
    located as `backend=hf` locates it), or an RMSNorm of the text config's eps for a class transformers lacks."""
    import torch

    from eaglekit.target.capture import find_decoder, text_config

    directory = Path(target_dir)
    module, path = None, "model.norm"
    if not isinstance(config, dict):
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
            with contextlib.suppress(ValueError), torch.device("meta"):
                model = auto.from_config(config, trust_remote_code=trust_remote_code)
                stack = find_decoder(model)
                if stack.norm is not None and stack.norm_path:
                    module, path = stack.norm, stack.norm_path
                break
    keys = _norm_keys(path, _checkpoint_keys(directory))
    if len(keys) != 1:
        raise EaglekitError(f"cannot find the final norm's weight ({path}.weight) in {directory}'s safetensors "
                            f"(candidates: {keys or 'none'}); use backend=hf")
    weight = _checkpoint_tensors(directory, keys)[keys[0]]
    if module is None:
        text = text_config(config) if not isinstance(config, dict) else config.get("text_config", config)
        eps = text.get("rms_norm_eps", 1e-6) if isinstance(text, dict) else getattr(text, "rms_norm_eps", 1e-6)
        return RMSNorm(weight, float(eps))
    module = module.to_empty(device="cpu")
    with torch.no_grad():
        module.weight.copy_(weight)
    return module.eval().requires_grad_(False)


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


class JsonlTail:
    """Complete lines appended to a file since the last read."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def read(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        with open(self.path, "rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]


class EngineSession:
    """The worker process and its two spool files; `events()` yields what it reports, raising on its failure."""

    def __init__(self, process: subprocess.Popen, spool: Path, log_path: Path, target: str):
        self.process, self.spool, self.log_path, self.target = process, spool, log_path, target
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
        return EaglekitError(f"the vLLM capture engine {how} (log {self.log_path}): {engine_error(text, self.target)}")


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
        session = EngineSession(process, spool, log_path, target)
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

    from eaglekit.target.extract import storage_rows

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
            raise EaglekitError(f"vLLM refused record {record.id}: {engine_error(event['error'], session.target)}")
        store_file(event["file"], record, layers, norm, layout, writer)
        counters.records += 1
        counters.tokens += len(record.input_ids)
        on_stored(record)
        send_more()
    counters.seconds = time.perf_counter() - session.ready_at
    counters.engine_startup_seconds = session.ready.get("startup_seconds", 0.0)
    return counters


# ---- regenerate and capture ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Regeneration:
    """How answers are generated, and how a record is made from one (as `extract` tokenises a conversation)."""

    tokenizer: Any
    chat_template: str
    max_length: int
    max_new_tokens: int
    temperature: float
    seed: int
    eos_ids: tuple[int, ...]
    context: int  # the engine's max_model_len: a prompt's answer is cut to what leaves room for the template's tail


TEMPLATE_TAIL = 16  # tokens a chat template may add after an answer (end of turn, newline)


def prompt_of(conversation: Any) -> Any:
    """The conversation without its last assistant turn(s): what the target answers."""
    from eaglekit.data import Conversation

    messages = list(conversation.messages)
    while messages and messages[-1].role == "assistant":
        messages.pop()
    return Conversation(conversation.id, tuple(messages))


def prompt_ids(regeneration: Regeneration, prompt: Any) -> list[int]:
    """Token ids of the prompt with the assistant's opening, as `regen backend=hf` encodes it."""
    from eaglekit.data.tokenize import render, template_messages

    text = render(regeneration.tokenizer, template_messages(prompt), regeneration.chat_template, True)
    return list(regeneration.tokenizer(text, add_special_tokens=False)["input_ids"])


def answered(regeneration: Regeneration, prompt: Any, output: list[int]) -> tuple[Any, str]:
    """The conversation with the generated answer (cut at the first end-of-sequence id), and the finish reason."""
    from eaglekit.data import Conversation, Message

    cut = next((i for i, token in enumerate(output) if token in regeneration.eos_ids), None)
    ids = output if cut is None else output[:cut]
    text = regeneration.tokenizer.decode(ids, skip_special_tokens=True)
    reason = "stop" if cut is not None else "length"
    return Conversation(prompt.id, (*prompt.messages, Message("assistant", text))), reason


def conversation_line(conversation: Any, meta: dict[str, Any]) -> dict[str, Any]:
    from eaglekit.data.tokenize import template_messages

    messages = [{k: v for k, v in m.items() if k != "thinking"} for m in template_messages(conversation)]
    return {"id": conversation.id, "messages": messages, "regen": meta}


def regenerate_records(session: EngineSession, conversations: list[Any], regeneration: Regeneration,
                       layers: EngineLayers, norm: Any, layout: StoreLayout, writer: ShardWriter, window: int,
                       on_stored: Callable[[Record, dict[str, Any]], None]) -> CaptureCounters:
    """For each conversation: a generation request (nothing saved), then a capture request of the record that
    `tokenize_conversation` makes from the answered conversation (request ids 2i and 2i + 1)."""
    import torch

    from eaglekit.data import tokenize_conversation
    from eaglekit.target.extract import Record
    from eaglekit.target.regen import record_seed

    counters = CaptureCounters()
    prompts = [prompt_of(c) for c in conversations]
    records: dict[int, tuple[Record, dict[str, Any]]] = {}
    state = {"sent": 0, "finished": 0}

    def send_more() -> None:
        while state["sent"] < len(prompts) and state["sent"] - state["finished"] < window:
            i = state["sent"]
            ids = prompt_ids(regeneration, prompts[i])
            budget = min(regeneration.max_new_tokens, regeneration.context - TEMPLATE_TAIL - len(ids))
            if budget < 1:
                raise EaglekitError(f"the prompt of record {prompts[i].id} has {len(ids)} tokens and leaves no room "
                                    f"for an answer in the engine's {regeneration.context}-token context")
            session.send({"id": 2 * i, "prompt": ids, "max_tokens": budget, "temperature": regeneration.temperature,
                          "seed": record_seed(regeneration.seed, prompts[i].id), "stop": list(regeneration.eos_ids),
                          "save": False})
            state["sent"] += 1
        if state["sent"] == len(prompts) and state["finished"] == len(prompts):
            session.send({"end": True})

    def finish() -> None:
        state["finished"] += 1
        send_more()

    send_more()
    for event in session.events():
        i, capture = divmod(event["id"], 2)
        if "error" in event:
            raise EaglekitError(f"vLLM refused record {prompts[i].id}: {engine_error(event['error'], session.target)}")
        if not capture:
            conversation, reason = answered(regeneration, prompts[i], event["output"])
            counters.generated_tokens += len(event["output"])
            counters.finish_reasons[reason] = counters.finish_reasons.get(reason, 0) + 1
            tokenized = tokenize_conversation(regeneration.tokenizer, conversation, regeneration.max_length,
                                              regeneration.chat_template or None)
            if not any(tokenized.loss_mask):  # an empty answer: nothing to learn, as extract skips it
                finish()
                continue
            record = Record(conversation.id, torch.tensor(tokenized.input_ids, dtype=torch.long),
                            torch.tensor(tokenized.loss_mask, dtype=torch.uint8))
            meta = {"backend": "vllm", "finish_reason": reason, "completion_tokens": len(event["output"])}
            records[i] = (record, conversation_line(conversation, meta))
            session.send({"id": 2 * i + 1, "prompt": tokenized.input_ids, "max_tokens": 1, "save": True})
            continue
        record, line = records.pop(i)
        store_file(event["file"], record, layers, norm, layout, writer)
        counters.records += 1
        counters.tokens += len(record.input_ids)
        on_stored(record, line)
        finish()
    counters.seconds = time.perf_counter() - session.ready_at
    counters.engine_startup_seconds = session.ready.get("startup_seconds", 0.0)
    return counters
