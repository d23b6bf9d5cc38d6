"""Before vLLM starts: will the vLLM an engine runs capture hidden states from a target, or serve a drafter for it?

The answer is the doctor's (`eaglekit.doctor.diagnose`), on the vLLM source that the engine's Python imports, with
the plugins where that Python loads them (beside vLLM, or on PYTHONPATH), and with the build's own limits (the CPU
build's attention head sizes, `eaglekit.doctor.limits`; the device type is the one `engine.probe` reported).
`extract backend=vllm`, `bench engine=vllm` and `eaglekit run`'s pre-flight (`capture=vllm`, `bench.engine=vllm`) ask
before any engine or stage starts: vLLM refuses the same targets, but only once it has loaded the weights (and, in a
run, after regen or training). A target the doctor cannot read (a hub id not on this disk, an architecture it does not
know) or calls "unknown" passes: vLLM has the last word, and its refusal is worded by `engine_error`s with
`doctor_advice`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eaglekit.errors import EaglekitError
from eaglekit.vllm import engine as ve

SERVING, CAPTURE = "serving", "capture"


def engine_source(engine: ve.Engine) -> str:
    """The vLLM package directory of the engine's venv ("" when its Python is not a venv's: the doctor then reads the
    vLLM this environment finds)."""
    sites = sorted(Path(engine.python).parent.parent.glob("lib/python3*/site-packages/vllm"))
    return str(sites[0]) if sites else ""


def engine_report(engine: ve.Engine, target: str) -> dict[str, Any] | None:
    """The doctor's report on `target` for the vLLM `engine` runs, on its device type; None when it cannot read."""
    from eaglekit.doctor.diagnose import diagnose

    try:
        return diagnose("vllm", target, engine_source(engine), device_type=engine.device_type)
    except EaglekitError:
        return None


def doctor_advice(engine: ve.Engine, target: str, report: dict[str, Any] | None = None) -> str:
    """What to do, from the doctor's report on the vLLM this engine runs: `--fix` only where it writes a plugin."""
    check = f"eaglekit doctor --engine vllm --target {target}"
    if report is None:
        from eaglekit.doctor.diagnose import diagnose

        try:
            report = diagnose("vllm", target, engine_source(engine), device_type=engine.device_type)
        except EaglekitError as error:
            return f"check the drafter export and the target with `{check}` ({error})"
    if report.get("plugin_fix_possible"):
        return (f"this vLLM's class for the target needs a plugin: run `{check} --fix` and pip-install the plugin "
                "it writes into vLLM's environment")
    if report["verdict"] != "supported":
        return f"the doctor ({check}) says: {'; '.join(report['fix'] or report['reasons'])}"
    return f"the doctor finds this target supported, so check the drafter export (and `{check}`)"


def refusal(engine: ve.Engine, target: str, use: str, report: dict[str, Any] | None) -> str | None:
    """Why this vLLM will not take `target` for `use` (SERVING a drafter, or CAPTURE of hidden states), with the fix;
    None when the doctor sees nothing against it."""
    from eaglekit.doctor.limits import head_size_reason

    if report is None:
        return None
    limit = report.get("cpu_attention") or {}
    if engine.device_type == "cpu" and limit.get("takes") is False:
        return (f"{head_size_reason(limit)}: run it on a GPU build of vLLM (a target whose head size is one of "
                f"{limit['sizes']} runs on this one)")
    verdict = (report.get("capture") or {}).get("verdict") if use == CAPTURE else report["verdict"]
    if verdict != "not supported":
        return None
    return doctor_advice(engine, target, report)


def check_served(engine: ve.Engine, target: str) -> None:
    """Refuse, before anything is measured, a target the doctor says this vLLM will not run with a drafter
    (`bench engine=vllm`)."""
    why = refusal(engine, target, SERVING, engine_report(engine, target))
    if why:
        raise EaglekitError(f"vLLM {engine.version} will not run {target} with a drafter: {why}; or leave engine=vllm "
                            "out (eaglekit's own figures need no vLLM)")


def check_captured(engine: ve.Engine, target: str) -> None:
    """Refuse, before the engine starts, a target the doctor says this vLLM will not capture hidden states from
    (`extract backend=vllm`)."""
    why = refusal(engine, target, CAPTURE, engine_report(engine, target))
    if why:
        raise EaglekitError(f"vLLM {engine.version} will not capture hidden states from {target}: {why}; or capture "
                            "them with backend=hf (run: capture=hf), into the same store")
