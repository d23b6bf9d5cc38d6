"""Diagnose a target: can vLLM/SGLang run EAGLE-3 for it (read from the engine's source), or what eaglekit sees in it.

    eaglekit doctor --engine vllm --target path/to/model            # or config.json, or LlamaForCausalLM
    eaglekit doctor --engine vllm --target meta-llama/Llama-3.1-8B-Instruct   # a hub id: its config.json
    eaglekit doctor --engine sglang --target config.json --engine_source sglang-0.5.23-...whl --json
    eaglekit doctor --engine vllm --target config.json --fix fix_output=plugins/   # write a delegation plugin
    eaglekit doctor --engine vllm --target config.json --plugins plugins/          # re-check with that plugin
    eaglekit doctor --target tiny                                                  # eaglekit's target report
    eaglekit doctor --engine vllm --coverage runs/doctor-coverage.json   # every registered architecture, classified

With `--engine`, the engine is never imported: its source is read from the installed package, a
source checkout or a wheel (`engine_source`), and the verdict (supported / not supported / unknown)
names the file, class and methods to change, and the aux layers the engine uses by default. For vLLM it
also checks what the EAGLE proposer reads of the target when it loads a drafter (its embedding), which a class
with the EAGLE-3 interface can still fail, and whether vLLM can capture hidden states from it (`extract
backend=vllm`); `--fix` writes a plugin where one can help.

Exit status (for scripts and CI): 0 supported (or `--fix` wrote its plugin, or no verdict was asked for: the target
report, `--coverage`), 3 not supported (also: `drafter_type` not served by that release), 4 unknown (the doctor read
the source but cannot tell); 1 when no report could be made (bad target, no engine source: the error says why).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from eaglekit import registry
from eaglekit.config import option
from eaglekit.errors import EaglekitError

log = logging.getLogger(__name__)

POSITIONAL = ("target",)


@dataclass(frozen=True)
class Config:
    target: str = option("", "config.json, model directory, hub id, 'tiny' or architecture name (without --engine: "
                             "a model eaglekit loads)")
    engine: str = option("", "serving engine whose source to check (empty: eaglekit's own target report)",
                         choices=("", "vllm", "sglang"))
    engine_source: str = option("",
                                "engine source: installed package dir, source checkout or .whl (default: installed)")
    plugins: tuple[str, ...] = option((), "vLLM plugin project directories to honour (installed plugins are read too)")
    installed_plugins: bool = option(True, "also read installed vllm.general_plugins entry points (those beside the "
                                           "vLLM read, else this environment's)")
    fix: bool = option(False, "vLLM: write an out-of-tree plugin that adds EAGLE-3 delegation to a wrapper class, or "
                              "exposes the target's embedding where vLLM's EAGLE proposer looks it up")
    fix_output: str = option("eaglekit-plugins", "directory the --fix plugin package is written under")
    overwrite: bool = option(False, "--fix: write the plugin's project folder even where something other than an "
                                    "earlier --fix wrote it")
    drafter_type: str = option("", "with --engine: also say whether that engine release serves this drafter type",
                               choices=("", *registry.names()))
    coverage: str = option("", "with --engine vllm and no target: classify every architecture of the engine's "
                                "registry (supported, fixable by --fix's plugins, not fixable, unknown), print the "
                                "counts and write the lists as JSON to this file")
    json: bool = option(False, "print the report as JSON")
    trust_remote_code: bool = option(False, "target report: allow the target's own modelling code")


def _target_report(config: Config) -> dict[str, Any]:
    try:
        from eaglekit.targets.inspection import format_target_report, target_report
    except ImportError as error:  # written by the capture part; not there in every checkout
        raise EaglekitError(f"the target report is not available in this install ({error}); use "
                            "--engine vllm|sglang") from None
    report = target_report(config.target, trust_remote_code=config.trust_remote_code)
    print(json.dumps(report, indent=2, default=str) if config.json else format_target_report(report))
    return report


EXIT_CODES = {"supported": 0, "not supported": 3, "unknown": 4}  # 1: an error (no report), 2: the CLI's usage error


def exit_code(result: dict[str, Any]) -> int:
    """The exit status of `eaglekit doctor` for its result (see the module docstring); `eaglekit run` records the
    verdict in doctor.json instead."""
    if "verdict" not in result or result.get("plugin_written"):
        return 0
    code = EXIT_CODES.get(result["verdict"], EXIT_CODES["unknown"])
    if code == 0 and result.get("drafter_type") and not result["drafter_type"]["served"]:
        return EXIT_CODES["not supported"]
    return code


def _coverage(config: Config) -> dict[str, Any]:
    from pathlib import Path

    from eaglekit.doctor.coverage import format_coverage, registry_coverage
    from eaglekit.manifest import atomic_write_json

    if config.engine != "vllm" or config.target or config.fix:
        raise EaglekitError("--coverage classifies every architecture of vLLM's registry: pass --engine vllm, and "
                            "no target or --fix")
    if Path(config.coverage).is_dir():
        raise EaglekitError(f"--coverage {config.coverage} is a directory; pass a file path, such as "
                            f"{Path(config.coverage) / 'doctor-coverage.json'}")
    coverage = registry_coverage(config.engine_source)
    atomic_write_json(config.coverage, coverage)
    print(json.dumps(coverage["counts"]) if config.json else format_coverage(coverage))
    print(f"written to {config.coverage}")
    return {"coverage": config.coverage, "counts": coverage["counts"]}


def run(config: Config) -> dict[str, Any]:
    if config.coverage:
        return _coverage(config)
    if not config.target:
        raise EaglekitError("no target given: eaglekit doctor --target <config.json | model dir | hub id | "
                            "architecture> [--engine vllm|sglang]")
    if not config.engine:
        if config.fix:
            raise EaglekitError("--fix needs --engine vllm")
        return _target_report(config)
    from eaglekit.doctor.diagnose import diagnose, format_report

    report = diagnose(config.engine, config.target, config.engine_source, config.plugins, config.installed_plugins)
    fix_error = None
    if config.fix and report["verdict"] != "supported":
        from eaglekit.doctor.plugin import write_vllm_plugin

        try:
            report["plugin_written"] = str(write_vllm_plugin(report, config.fix_output, config.overwrite))
        except EaglekitError as error:  # print the report that explains why first
            fix_error = error
    if config.drafter_type:
        from eaglekit.doctor.drafter_support import drafter_type_support, format_support
        from eaglekit.doctor.source import open_source

        report["drafter_type"] = drafter_type_support(open_source(config.engine, config.engine_source), config.engine,
                                                      config.drafter_type)
    print(json.dumps(report, indent=2, default=str) if config.json else format_report(report))
    if config.drafter_type and not config.json:
        print(format_support(report["drafter_type"], config.engine))
    if fix_error is not None:
        raise fix_error
    if config.fix and report["verdict"] == "supported":
        print("\n--fix: nothing to fix, the engine already supports EAGLE-3 for this target")
    elif config.fix:
        print(f"\nplugin written to {report['plugin_written']}: `pip install {report['plugin_written']}` in vLLM's "
              f"environment, then check with: eaglekit doctor --engine vllm --target {config.target} "
              f"--plugins {config.fix_output}")
    return report
