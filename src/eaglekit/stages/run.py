"""Run the whole path (regen, extract, vocab, train, bench, export, doctor) into one folder, resumably, with a report.

    eaglekit run --target meta-llama/Llama-3.1-8B-Instruct --data prompts.jsonl --out runs/llama
    eaglekit run --config src/eaglekit/recipes/demo.yaml            # the built-in tiny target on the CPU
    eaglekit run --config recipe.yaml train.lr=5e-5 bench.num_prompts=20

Each stage runs into its own subfolder of `out` (`regen/`, `extract/`, `vocab/`, `train/`, `bench/`,
`export/<format>/`, `doctor/<engine>/`) with its resolved config and manifest. A stage's options live in
the section of the same name (`train: {lr: 5e-5}` or `train.lr=5e-5`) and are checked against that
stage's own options; the paths that connect the stages are filled in here. Re-running skips every
stage that finished with the same options and inputs; a changed option re-runs that stage and the
stages that read its output. Ctrl-C at any point and re-run: finished stages are kept, an interrupted
one resumes its own partial work. `out/report.md` (with PNG plots) is rewritten at the end of every run.
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

from eaglekit.config import option, save_resolved, to_dict
from eaglekit.errors import EaglekitError
from eaglekit.formats.names import EXPORT_FORMATS
from eaglekit.pipeline import Step, StepRecord, run_steps
from eaglekit.stages import bench as _bench
from eaglekit.stages import doctor as _doctor
from eaglekit.stages import export as _export
from eaglekit.stages import extract as _extract
from eaglekit.stages import load_stage
from eaglekit.stages import regen as _regen
from eaglekit.stages import train as _train
from eaglekit.stages import vocab as _vocab

log = logging.getLogger(__name__)

PIPELINE = ("regen", "extract", "vocab", "train", "bench", "export", "doctor")
ENGINES = ("vllm", "sglang")
PACKAGE_DIR = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Config:
    # the options' ranges (the run's and every section's) are checked when the run plans: one error naming the
    # stage that would refuse each (`check_sections`)
    CHECK_ON_LOAD: ClassVar[bool] = False

    target: str = option("", "target model directory, hub id or 'tiny' (the built-in tiny target)")
    data: tuple[str, ...] = option((), "prompt/conversation files; 'tiny' = the shipped tiny prompts; paths "
                                       "may be package-relative")
    out: str = option("", "run directory: one subfolder per stage, run.yaml, run.json, report.md")
    overwrite: bool = option(False, "run into a directory that is not empty and was not written by eaglekit run")
    device: str = option("auto", "device for every stage that loads a model (a section's own device wins)")
    trust_remote_code: bool = option(False, "allow the target's own modelling code in every stage")
    skip_errors: bool = option(False, "skip malformed records of the data in every stage that reads them (regen, "
                                      "extract, vocab, train, bench) instead of stopping; a section's own "
                                      "skip_errors=true skips them in that stage alone")
    stages: tuple[str, ...] = option(PIPELINE,
                                     "stages to run, in pipeline order (leave out regen to train on data as is)")
    training: str = option("offline",
                           "offline: extract hidden states, train from them; online: train runs the target, no extract",
                           choices=("offline", "online"))
    export_formats: tuple[str, ...] = option(EXPORT_FORMATS, "checkpoint layouts to export (vllm, sglang, speculators)")
    doctor_engines: tuple[str, ...] = option(ENGINES, "engines the doctor checks the target against (vllm, sglang)")
    capture: str = option("hf", "who captures the hidden states for extract: hf (the target in eaglekit's process) "
                                "or vllm (vLLM's extract_hidden_states; extract.tensor_parallel_size etc. apply)",
                          choices=("hf", "vllm"))
    drafter_types: tuple[str, ...] = option((), "drafter types to train on the same data and compare in the report "
                                                "(eagle3, p-eagle, dflash): the first is the run's drafter (train/, "
                                                "bench/, export/); each other one trains into train-<type>/ and is "
                                                "benched into bench-<type>/ on the same prompts. Empty: "
                                                "train.drafter_type alone")
    extract_processes: int = option(1, "> 1: run extract under torchrun with this many processes (one GPU "
                                       "each, data-parallel)", min=1)
    train_processes: int = option(1, "> 1: run train under torchrun with this many processes (DDP, or FSDP2 with "
                                     "train.distributed=fsdp)", min=1)
    regen: _regen.Config = option(_regen.Config(), "regen options (section)")
    extract: _extract.Config = option(_extract.Config(), "extract options (section)")
    vocab: _vocab.Config = option(_vocab.Config(), "vocab options (section)")
    train: _train.Config = option(_train.Config(), "train options (section)")
    bench: _bench.Config = option(_bench.Config(), "bench options (section)")
    export: _export.Config = option(_export.Config(), "export options (section), used for every format")
    doctor: _doctor.Config = option(_doctor.Config(), "doctor options (section), used for every engine")


# ---- inputs ---------------------------------------------------------------------------------------

def resolve_data_path(value: str) -> str:
    """'tiny'/'tiny-eval' -> the shipped prompt files; a path that does not exist here is looked up in the package."""
    from eaglekit.data.readers import SHIPPED_DATA

    if value in SHIPPED_DATA:
        return str(SHIPPED_DATA[value])
    path = Path(value).expanduser()
    if path.exists():
        return str(path)
    if not path.is_absolute() and (PACKAGE_DIR / path).exists():
        return str(PACKAGE_DIR / path)
    raise EaglekitError(f"data {value} does not exist (here or inside the eaglekit package); pass an existing file, "
                        "or data=tiny for the shipped prompts")


def _target_inputs(target: str) -> tuple[str, ...]:
    """The target's local folder (fingerprinted into every key), or nothing for a hub id."""
    from eaglekit.targets.loading import resolve_target

    resolved = resolve_target(target)
    return (resolved,) if Path(resolved).is_dir() else ()


def _check(config: Config) -> tuple[str, ...]:
    """The stages this run has, after checking the combination."""
    if not config.target:
        raise EaglekitError("no target: eaglekit run --target MODEL --data PROMPTS --out DIR (or --config recipe.yaml)")
    if not config.data:
        raise EaglekitError("no data: pass --data PROMPTS.jsonl (or data=tiny for the shipped prompts)")
    if not config.out:
        raise EaglekitError("no run directory: pass --out DIR")
    unknown = [s for s in config.stages if s not in PIPELINE]
    if unknown:
        raise EaglekitError(f"unknown stages {unknown} in stages=; choose from {', '.join(PIPELINE)}")
    stages = tuple(s for s in PIPELINE if s in config.stages and not (s == "extract" and config.training == "online"))
    if config.training == "offline" and "train" in stages and "extract" not in stages:
        raise EaglekitError("training=offline trains from extracted hidden states: add extract to stages, "
                            "or set training=online")
    if ("bench" in stages or "export" in stages) and "train" not in stages:
        raise EaglekitError("bench and export use the drafter that train writes: keep train in stages "
                            "(a finished train stage is skipped on re-run, not trained again)")
    if config.extract_processes > 1 and config.capture == "vllm":
        raise EaglekitError("capture=vllm runs one engine (it shards the target itself: extract.tensor_parallel_size); "
                            "use extract_processes=1")
    if config.extract_processes > 1 and config.extract.device_map:
        raise EaglekitError("extract.device_map spreads one target over the GPUs of one process: use it "
                            "with extract_processes=1")
    if config.train.device_map and (config.train_processes > 1 or config.training == "offline"):
        raise EaglekitError("train.device_map spreads one target over the GPUs of one process for online "
                            "training: use it with training=online and train_processes=1 (offline training "
                            "never loads the target)")
    _drafter_types(config)
    for name, chosen, valid in (("export_formats", config.export_formats, EXPORT_FORMATS),
                                ("doctor_engines", config.doctor_engines, ENGINES)):
        if any(v not in valid for v in chosen):
            raise EaglekitError(f"{name}={','.join(chosen)}: choose from {', '.join(valid)}")
    return stages


def _drafter_types(config: Config) -> tuple[str, ...]:
    """The drafter types this run trains, the run's own drafter first: `drafter_types`, else train.drafter_type."""
    from eaglekit import registry

    kinds = config.drafter_types or (config.train.drafter_type,)
    unknown = [k for k in kinds if k not in registry.names()]
    if unknown or len(set(kinds)) != len(kinds):
        raise EaglekitError(f"drafter_types={','.join(kinds)}: name each of {', '.join(registry.names())} at most "
                            "once")
    if config.drafter_types and config.train.drafter_type not in (_train.Config().drafter_type, kinds[0]):
        raise EaglekitError(f"train.drafter_type={config.train.drafter_type} and drafter_types={','.join(kinds)} "
                            "disagree on the run's drafter: drop train.drafter_type (the first of drafter_types is "
                            "the run's drafter)")
    return kinds


def stage_config(config: Config, name: str, **wired: Any) -> Any:
    """The section `name` of the run config with the connecting paths (`wired`) filled in.

    A wired option set in the section to something else is refused: the run decides where stages read
    and write. `device` comes from the run unless the section sets its own; `trust_remote_code` and `skip_errors`
    set on the run are set in every section that has them.
    """
    section = getattr(config, name)
    default = type(section)()
    for key, value in wired.items():
        mine = getattr(section, key)
        if mine != getattr(default, key) and mine != value:
            raise EaglekitError(f"{name}.{key} is set by eaglekit run (to {value!r}); remove "
                                f"{name}.{key} from the recipe")
    fill: dict[str, Any] = {}
    if hasattr(section, "device") and section.device == default.device:
        fill["device"] = config.device
    for flag in ("trust_remote_code", "skip_errors"):
        if hasattr(section, flag) and getattr(config, flag):
            fill[flag] = True
    return dataclasses.replace(section, **{**fill, **wired})


# ---- the plan -------------------------------------------------------------------------------------

def _execute(name: str, processes: int = 1, directory: Path | None = None) -> Callable[[Any], Any]:
    """Runs the stage in this process (looked up when it runs, so a test can replace its `run`), or under torchrun."""
    if processes > 1:
        assert directory is not None
        return lambda stage_config: torchrun(name, stage_config, processes, directory)
    return lambda stage_config: load_stage(name).run(stage_config)


def torchrun_command(name: str, config_file: Path, processes: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
            "-m", "eaglekit", name, "--config", str(config_file)]


def torchrun(name: str, stage_config: Any, processes: int, directory: Path) -> dict[str, Any] | None:
    """Run a stage as `torchrun --nproc-per-node N -m eaglekit <stage> --config <its resolved config>`."""
    from eaglekit.manifest import read_manifest

    command = torchrun_command(name, save_resolved(stage_config, directory, name="launch.yaml"), processes)
    log.info("%s: %s", name, " ".join(command))
    completed = subprocess.run(command, check=False)  # Ctrl-C reaches the workers too: they share our process group
    if completed.returncode != 0:
        raise EaglekitError(f"{name} under torchrun exited with {completed.returncode} (see its log above); "
                            "fix the cause and re-run the same command: finished stages are kept, this one resumes")
    return read_manifest(directory)


def _inherit(section: Any, default: Any, key: str, value: Any) -> Any:
    return value if getattr(section, key) == getattr(default, key) else getattr(section, key)


def _vocab_init_from(config: Config, vocab: _vocab.Config) -> dict[str, Any]:
    """Fine-tuning (`train.init_from`): the vocab step keeps the drafter's own mapping (train refuses another one),
    or builds a new one when train remaps (`train.rebuild_vocab`). Values set in the vocab section win."""
    default = _vocab.Config()
    return {"init_from": _inherit(vocab, default, "init_from", config.train.init_from),
            "rebuild": _inherit(vocab, default, "rebuild", config.train.rebuild_vocab)}


def _data_steps(config: Config, stages: tuple[str, ...], out: Path, data: tuple[str, ...],
                target: tuple[str, ...]) -> tuple[list[Step], tuple[str, ...], tuple[str, ...]]:
    """regen (when asked) -> (steps, training conversations, step names they come from)."""
    if "regen" not in stages:
        return [], data, ()
    regen = stage_config(config, "regen", data=data, output=str(out / "regen"), target=config.target)
    step = Step("regen", out / "regen", lambda: regen, _execute("regen"), after=(), inputs=(*data, *target),
                outputs=("manifest.json",))
    return [step], (str(out / "regen" / _regen.OUTPUT_FILE),), ("regen",)


def check_sections(config: Config) -> None:
    """Every option of every section (and of the run) within its declared range, or one error naming each bad one
    as `section.key` and the stages that would refuse them."""
    from eaglekit.config import option_problems, out_of_range

    problems = option_problems(config)
    if not problems:
        return
    stages = list(dict.fromkeys(p.key.split(".")[0] if "." in p.key else "run" for p in problems))
    who = ", ".join(stages[:-1]) + (" and " if len(stages) > 1 else "") + stages[-1]
    raise EaglekitError(f"{who} would refuse {'this option' if len(problems) == 1 else 'these options'}, so nothing "
                        f"ran: {out_of_range(problems)}")


def plan(config: Config) -> list[Step]:
    """Every step of this run with its config built (so a bad option fails before anything runs)."""
    check_sections(config)
    stages = _check(config)
    out, target = Path(config.out), _target_inputs(config.target)
    data = tuple(resolve_data_path(d) for d in config.data)
    steps, conversations, source = _data_steps(config, stages, out, data, target)
    inputs = (*target, *(() if source else data))
    online = config.training == "online"
    init_from = (config.train.init_from,) if config.train.init_from and Path(config.train.init_from).exists() else ()
    if "extract" in stages:
        extract = stage_config(config, "extract", data=conversations, output=str(out / "extract"), target=config.target)
        if config.capture == "vllm":
            extract = dataclasses.replace(extract, backend="vllm")
        steps.append(Step("extract", out / "extract", lambda: extract,
                          _execute("extract", config.extract_processes, out / "extract"),
                          source, inputs, ("manifest.json",)))
    if "vocab" in stages:
        length_from = config.train if online else config.extract
        vocab = stage_config(config, "vocab", data=conversations, output=str(out / "vocab"), target=config.target)
        vocab = dataclasses.replace(vocab,
                                    max_length=_inherit(vocab, _vocab.Config(), "max_length", length_from.max_length),
                                    **_vocab_init_from(config, vocab))
        steps.append(Step("vocab", out / "vocab", lambda: vocab, _execute("vocab"), source, (*inputs, *init_from),
                          ("manifest.json",)))
    if "train" in stages:
        vocab_file = str(out / "vocab" / "vocab.safetensors") if "vocab" in stages else config.train.vocab
        train = stage_config(config, "train", target=config.target, output=str(out / "train"), resume=True,
                             vocab=vocab_file,
                             shards="" if online else str(out / "extract"), data=conversations if online else ())
        after = (*(source if online else ("extract",)), *(("vocab",) if "vocab" in stages else ()))
        kinds = _drafter_types(config)
        train = dataclasses.replace(train, drafter_type=kinds[0])
        steps.append(Step("train", out / "train", lambda: train,
                          _execute("train", config.train_processes, out / "train"),
                          after, (*inputs, *init_from), ("manifest.json", "model.safetensors")))
        for kind in kinds[1:]:
            steps.append(_other_train_step(config, train, kind, out, after, (*inputs, *init_from)))
    steps += _later_steps(config, stages, out, data, target)
    return steps


def _other_train_step(config: Config, train: Any, kind: str, out: Path, after: tuple[str, ...],
                      inputs: tuple[str, ...]) -> Step:
    """A further drafter type trained on the run's data into train-<kind>/: a type that starts from another
    (`starts_from`: P-EAGLE from EAGLE-3, the usual recipe) starts from the run's drafter when that is of the type,
    unless train.init_from is set; the other options are the train section's."""
    from eaglekit import registry

    folder = out / f"train-{kind}"
    from_run = registry.get(kind).starts_from == train.drafter_type and not config.train.init_from
    other = dataclasses.replace(train, drafter_type=kind, output=str(folder),
                                init_from=str(out / "train") if from_run else train.init_from)
    return Step(f"train-{kind}", folder, lambda: other, _execute("train", config.train_processes, folder),
                (*after, *(("train",) if from_run else ())), inputs, ("manifest.json", "model.safetensors"))


def _later_steps(config: Config, stages: tuple[str, ...], out: Path, data: tuple[str, ...],
                 target: tuple[str, ...]) -> list[Step]:
    steps: list[Step] = []
    drafter = str(out / "train")
    if "bench" in stages:
        prompts = resolve_data_path(config.bench.prompts) if config.bench.prompts else data[0]
        if not config.bench.prompts:
            log.warning("bench: no bench.prompts given, measuring on the training prompts %s (acceptance reads high); "
                        "set bench.prompts to prompts the drafter never saw", prompts)
        bench = stage_config(config, "bench", target=config.target, drafter=drafter, output=str(out / "bench"))
        bench = dataclasses.replace(bench, prompts=prompts, **_bench_for(config, bench, _drafter_types(config)[0]))
        steps.append(Step("bench", out / "bench", lambda: bench, _execute("bench"), ("train",), (*target, prompts),
                          ("bench.json",)))
        for kind in _drafter_types(config)[1:] if "train" in stages else ():
            other = stage_config(config, "bench", target=config.target, drafter=str(out / f"train-{kind}"),
                                 output=str(out / f"bench-{kind}"))
            other = dataclasses.replace(other, prompts=prompts, **_bench_for(config, other, kind, also=True))
            steps.append(Step(f"bench-{kind}", out / f"bench-{kind}", (lambda c=other: c), _execute("bench"),
                              (f"train-{kind}",), (*target, prompts), ("bench.json",)))
    if "export" in stages:
        for fmt in _export_formats(config):
            export = stage_config(config, "export", drafter=drafter, to=fmt, output=str(out / "export" / fmt))
            steps.append(Step(f"export-{fmt}", out / "export" / fmt, (lambda c=export: c), _execute("export"),
                              ("train",), (),
                              ("manifest.json", "config.json")))
    if "doctor" in stages:
        for engine in config.doctor_engines:
            folder = out / "doctor" / engine
            doctor = stage_config(config, "doctor", target=config.target, engine=engine)
            doctor = dataclasses.replace(doctor, fix=doctor.fix and engine == "vllm",  # the --fix plugin is vLLM's
                                         fix_output=_inherit(doctor, _doctor.Config(), "fix_output",
                                                             str(folder / "plugin")))
            steps.append(Step(f"doctor-{engine}", folder, (lambda c=doctor: c), _doctor_step(folder),
                              (), target, ("doctor.json",)))
    return steps


def _export_formats(config: Config) -> tuple[str, ...]:
    """The layouts to export: left at the default, those the trained drafter type exports to (no sglang for
    p-eagle or dflash); a layout asked for by name that the type has not is one error before any stage runs."""
    from eaglekit import registry

    kind = registry.get(_drafter_types(config)[0])
    lacking = [f for f in config.export_formats if f not in kind.export_formats]
    if not lacking:
        return config.export_formats
    kept = tuple(f for f in config.export_formats if f in kind.export_formats)
    if config.export_formats != Config().export_formats:
        raise EaglekitError(f"export_formats includes {','.join(lacking)}, which serves no {kind.name} drafter: drop "
                            f"it (export_formats={','.join(kept)})")
    return kept


def _bench_for(config: Config, bench: Any, kind: str, also: bool = False) -> dict[str, Any]:
    """The bench section's methods and chain length for a drafter of type `kind`. Left at their defaults: a type
    whose methods bench measures by default (eagle3: chain, tree) keeps them; another type gets plain and every
    method it drafts (p-eagle: parallel, chain, tree side by side; dflash: dflash), with the options its type sets
    (dflash: over the whole block, chain_length = block_size - 1). A further type of `drafter_types` (`also`) gets
    every method it drafts and nothing else (bench.methods is the run's drafter's): its speed-up is over the run
    bench's plain decoding."""
    from eaglekit import registry

    default, kind_type = _bench.Config(), registry.get(kind)
    own = kind_type.methods
    if also:
        chosen: dict[str, Any] = {"methods": own}
    elif set(own) <= set(default.methods):
        return {}
    else:
        chosen = {"methods": _inherit(bench, default, "methods", ("plain", *own))}
    for key, value in kind_type.bench_options(config.train).items():
        chosen[key] = _inherit(bench, default, key, value)
    return chosen


def _doctor_target(target: str) -> str:
    """What the doctor reads: the target's folder (a hub model's cached snapshot when the hub is not reachable), or a
    hub model's config.json."""
    from huggingface_hub import hf_hub_download

    from eaglekit.targets.loading import locate_target

    located = locate_target(target)
    return located if Path(located).exists() else hf_hub_download(located, "config.json")


def _doctor_step(directory: Path) -> Callable[[Any], Any]:
    """The doctor for one engine; an engine whose source is not here gives the verdict 'unknown', not a failed run."""
    from eaglekit.manifest import atomic_write_json, write_manifest

    def go(config: Any) -> dict[str, Any]:
        config = dataclasses.replace(config, target=_doctor_target(config.target))
        try:
            result = load_stage("doctor").run(config)
        except EaglekitError as error:
            log.warning("doctor %s: %s", config.engine, error)
            result = {"engine": config.engine, "engine_version": None, "verdict": "unknown", "reasons": [str(error)],
                      "fix": []}
        atomic_write_json(directory / "doctor.json", result)
        save_resolved(config, directory)
        write_manifest(directory, "doctor", {"engine": config.engine, "verdict": result.get("verdict")})
        return result
    return go


def check_data(steps: list[Step], out: Path) -> None:
    """Read the files each step reads from outside the run folder (the data, bench's prompts) as that step will,
    honouring its skip_errors: a malformed record is one error now, naming the first step it would stop and the fix
    (`skip_errors=true` on the run skips malformed records in every stage), not a failure after hours of work."""
    from eaglekit.data import read_conversations

    read: set[tuple[tuple[str, ...], bool]] = set()
    for step in steps:
        config = step.make_config()
        files = (*getattr(config, "data", ()), *((config.prompts,) if getattr(config, "prompts", "") else ()))
        files = tuple(f for f in files if out.resolve() not in Path(f).resolve().parents)
        skip = bool(getattr(config, "skip_errors", False))
        if not files or (files, skip) in read:
            continue
        read.add((files, skip))
        try:
            read_conversations(list(files), skip_errors=skip)
        except EaglekitError as error:
            raise EaglekitError(f"{step.name} would stop at its data, so nothing ran: {error}") from None


# ---- the run --------------------------------------------------------------------------------------

def _summary(records: list[StepRecord]) -> list[dict[str, Any]]:
    return [{"stage": r.name, "status": r.status, "seconds": round(r.seconds, 2), "key": r.key,
             "peak_gpu_gb": None if r.peak_gpu_bytes is None else round(r.peak_gpu_bytes / 1e9, 2),
             "directory": str(r.directory) if r.directory else None} for r in records]


def run(config: Config) -> dict[str, Any]:
    from eaglekit.manifest import atomic_write_json, claim_output
    from eaglekit.preflight import check_steps, check_tokenizer
    from eaglekit.report import headline_text, write_report
    from eaglekit.targets.loading import locate_target

    steps = plan(config)
    locate_target(config.target)  # a hub id neither served nor cached: one error now, not after training
    check_data(steps, Path(config.out))  # a malformed record: one error now, for the stage that reads it
    check_steps(steps, config.target, config.trust_remote_code, _bench._check)  # what bench/export would refuse
    check_tokenizer(config.target, config.trust_remote_code)  # every stage tokenises
    log.info("pre-flight: %s would accept this target and these options", ", ".join(s.name for s in steps))
    out = claim_output(config.out, "run", config.overwrite)
    save_resolved(config, out, name="run.yaml")
    log.info("run: %d stages into %s: %s", len(steps), out, ", ".join(s.name for s in steps))
    records = run_steps(steps)
    atomic_write_json(out / "run.json", {"config": to_dict(config), "steps": _summary(records)})
    report = write_report(out)
    ran = sum(r.status == "ran" for r in records)
    print(f"\nrun finished: {ran} stage(s) ran, {len(records) - ran} skipped (finished earlier with the same options)")
    print(f"report: {report.path}")
    print(headline_text(report.headline))
    return {"report": str(report.path), "headline": report.headline, "steps": _summary(records)}
