"""Runs inside vLLM's own Python (stdlib + vllm only): the engine half of `eaglekit extract backend=vllm`.

    VLLM_PYTHON vllm_capture_worker.py JOB.json

One offline `vllm.LLM` with `extract_hidden_states` (the layers in `job["layer_ids"]`, sorted and distinct, as
vLLM returns them in layer order) and eaglekit's connector (`vllm_capture_connector`), fed through two
append-only JSON-lines files in `job["spool"]`:

- `requests.jsonl` (written by eaglekit): `{"id", "prompt": [token ids], "max_tokens", "temperature", "seed",
  "stop": [ids], "save": bool}` per request, then `{"end": true}`;
- `events.jsonl` (written here): `{"event": "ready"}` once the engine is up; per finished request `{"id",
  "output": [ids], "finish_reason", "file": path or null}` once its file is complete on disk (null for
  `save: false`); `{"id", "error"}` for a request the engine refused; `{"event": "done", ...}` at the end.

The engine is stepped here (continuous batching): at most `max_in_flight` requests run at once and none is added
while `max_spool` finished files wait for eaglekit to take them (it deletes each one once stored), so the disk
holds a bounded number of per-request files. The last requests' files are written in the step after they finish,
so the engine is stepped until every file is there. eaglekit stops this process's group after `done`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import time
import traceback

from vllm_worker_common import JsonlTail, error_text

READY_POLL_SECONDS = 0.02


class Events:
    def __init__(self, path: str):
        self.handle = open(path, "a", buffering=1)

    def write(self, event: dict) -> None:
        self.handle.write(json.dumps(event) + "\n")
        self.handle.flush()


def file_complete(path: str) -> bool:
    """The file exists and no writer holds its lock (the CUDA connector writes asynchronously under a lock)."""
    if not os.path.exists(path):
        return False
    lock = path + ".lock"
    if not os.path.exists(lock):
        return True
    with open(lock) as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
    os.remove(lock)
    return True


def build_llm(job: dict):
    from vllm import LLM
    from vllm.platforms import current_platform

    args = dict(job["engine_args"])
    locks = current_platform.is_cuda_alike()  # only the asynchronous CUDA write needs a lock per file
    args["speculative_config"] = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "draft_model_config": {"hf_config": {
                                      "eagle_aux_hidden_state_layer_ids": job["layer_ids"]}}}
    args["kv_transfer_config"] = {"kv_connector": "EaglekitHiddenStatesConnector", "kv_role": "kv_producer",
                                  "kv_connector_module_path": "vllm_capture_connector",
                                  "kv_connector_extra_config": {"shared_storage_path": job["spool"],
                                                                "use_synchronization_lock": locks}}
    return LLM(model=job["model"], **args)


def sampling(request: dict):
    from vllm import SamplingParams

    return SamplingParams(temperature=request.get("temperature", 0.0), max_tokens=request.get("max_tokens", 1),
                          seed=request.get("seed"), stop_token_ids=request.get("stop") or None,
                          extra_args={"kv_transfer_params": {"save": request.get("save", True)}})


class Loop:
    """Admit requests, step the engine, announce finished requests whose files are complete."""

    def __init__(self, llm, job: dict, events: Events):
        self.engine, self.job, self.events = llm.llm_engine, job, events
        self.requests = JsonlTail(os.path.join(job["spool"], "requests.jsonl"))
        self.queued: list[dict] = []
        self.running: set[str] = set()
        self.waiting: dict[str, dict] = {}  # finished, file not complete yet
        self.ended = False
        self.tokens = self.steps = 0

    def spooled(self) -> int:
        return sum(name.endswith(".safetensors") for name in os.listdir(self.job["spool"]))

    def admit(self) -> None:
        for request in self.requests.read():
            if request.get("end"):
                self.ended = True
            else:
                self.queued.append(request)
        while self.queued and len(self.running) < self.job["max_in_flight"] and self.spooled() < self.job["max_spool"]:
            from vllm.inputs import TokensPrompt

            request = self.queued.pop(0)
            key = str(request["id"])
            try:
                self.engine.add_request(key, TokensPrompt(prompt_token_ids=request["prompt"]), sampling(request))
            except Exception as error:  # noqa: BLE001 - the engine's refusal (too long, ...) goes back to eaglekit
                self.events.write({"id": request["id"], "error": f"{type(error).__name__}: {error}"})
                continue
            self.running.add(key)
            self.tokens += len(request["prompt"])

    def collect(self, outputs) -> None:
        for output in outputs:
            if not output.finished:
                continue
            self.running.discard(output.request_id)
            params = output.kv_transfer_params or {}
            self.waiting[output.request_id] = {"id": int(output.request_id), "file": params.get("hidden_states_path"),
                                               "output": list(output.outputs[0].token_ids),
                                               "finish_reason": output.outputs[0].finish_reason}
        for key, event in list(self.waiting.items()):
            if event["file"] is None or file_complete(event["file"]):
                self.events.write(self.waiting.pop(key))

    def run(self) -> None:
        while True:
            self.admit()
            if not self.running and not self.waiting and not self.queued:
                if self.ended:
                    return
                time.sleep(READY_POLL_SECONDS)
                continue
            if not self.running and not self.engine.has_unfinished_requests():
                time.sleep(READY_POLL_SECONDS)  # files of finished requests still being written (CUDA)
            self.collect(self.engine.step())
            self.steps += 1


def die_with_parent() -> None:
    """A killed eaglekit (kill -9 included) takes this engine with it (Linux: the parent-death signal)."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before the call above
        sys.exit(1)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: vllm_capture_worker.py JOB.json", file=sys.stderr)
        return 2
    die_with_parent()
    with open(argv[1]) as handle:
        job = json.load(handle)
    events = Events(os.path.join(job["spool"], "events.jsonl"))
    try:
        import vllm

        started = time.perf_counter()
        llm = build_llm(job)
        events.write({"event": "ready", "vllm": vllm.__version__, "startup_seconds": time.perf_counter() - started})
        loop = Loop(llm, job, events)
        begin = time.perf_counter()
        loop.run()
        events.write({"event": "done", "seconds": time.perf_counter() - begin, "steps": loop.steps,
                      "prompt_tokens": loop.tokens})
    except Exception as error:  # noqa: BLE001 - eaglekit reads the failure from the events file and the log
        traceback.print_exc()
        events.write({"event": "failed", "error": error_text(error)})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
