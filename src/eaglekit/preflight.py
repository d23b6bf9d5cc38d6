"""Pre-flight of `eaglekit run`: what the later stages would refuse, checked before the first stage runs.

A run trains for minutes to days before bench, export and doctor run, and each of those refuses some targets,
drafters and options. `check_steps(steps, ...)` asks, for every step of the plan, what its stage would refuse,
from the target's config.json and the stages' resolved configs (no weights loaded, nothing written), and raises
the first refusal as one `EaglekitError` naming the stage and the fix:

- extract with `capture=vllm` (backend=vllm): an installed vLLM of the tested version that the doctor does not call
  "not supported" for capturing from the target, and whose build's attention takes the target's head size
  (`vllm.support.check_captured`): checked before regen, the run's first stage;
- bench: its own option checks (methods, drafter, repeats, ...), a readable prompt file with conversations, a
  target that speculative decoding can run (`decode.windows.check_speculative`: full and sliding-window attention
  layers only) when it measures chain or tree, the static fast path's coverage with `backend=static`, and with
  `engine=vllm` an installed vLLM of the tested version that the doctor does not call "not supported" for serving
  a drafter of the target, and whose build's attention takes its head size (`vllm.support.check_served`);
- export: for each format, the drafter that train will build (its type's `planned_config`: shapes from the target,
  aux layers, variant flags, `drafter_arch`; or `init_from`'s own config) against that format's rules (the type's
  `check_exportable`);
- doctor: nothing; a doctor that cannot read an engine reports the verdict "unknown" instead of failing the run.

`check_tokenizer(target)`: every stage of a run tokenises, so a target without a tokenizer that loads is refused
before anything is written (`run` calls it after `check_steps`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from eaglekit import registry
from eaglekit.errors import EaglekitError


def _refused(stage: str, error: EaglekitError, when: str = " after training") -> EaglekitError:
    return EaglekitError(f"{stage} would refuse this run{when}, so nothing ran: {error}")


def check_capture(config: Any) -> None:
    """What `eaglekit extract backend=vllm` refuses of its target before the engine starts (config:
    `eaglekit.stages.extract.Config`): vLLM missing or of another version, a target it will not capture from."""
    from eaglekit.targets.loading import local_model_dir
    from eaglekit.vllm.engine import find_engine
    from eaglekit.vllm.support import check_captured

    check_captured(find_engine(config.vllm_python, config.vllm_version_check), local_model_dir(config.target))


def check_decoding(target_config: Any, methods: Iterable[str], backend: str, name: str) -> None:
    """Refuse decoding methods the target cannot run: drafting methods on layers speculative decoding does not cover,
    backend=static on a target the static fast path does not cover."""
    from eaglekit.decode.windows import check_speculative

    methods = list(methods)
    if any(m in registry.method_names() for m in methods):
        try:
            check_speculative(target_config, name)
        except EaglekitError as error:
            plain = ",".join(m for m in methods if m not in registry.method_names()) or "plain"
            raise EaglekitError(f"{error} (bench: methods={plain})") from None
    if backend == "static":
        from eaglekit.decode.static import check_static_target

        check_static_target(target_config)


def check_bench(config: Any, target_config: Any, methods: list[str]) -> None:
    """What `eaglekit bench` refuses of its target and inputs before anything is measured (config:
    `eaglekit.stages.bench.Config`; `methods`: those it measures, after its own option check)."""
    from eaglekit.data import read_conversations

    if not read_conversations(config.prompts, skip_errors=config.skip_errors):
        raise EaglekitError(f"{config.prompts} holds no conversations: pass bench.prompts= a conversation file")
    check_decoding(target_config, methods, config.backend, config.target)
    if config.engine == "vllm":
        from eaglekit.vllm.engine import find_engine

        from eaglekit.vllm.support import check_served
        from eaglekit.targets.loading import local_model_dir

        check_served(find_engine(config.vllm_python, config.vllm_version_check), local_model_dir(config.target))


def check_tokenizer(target: str, trust_remote_code: bool = False) -> None:
    """Refuse a target whose tokenizer does not load (no tokenizer files in its folder, say): one line naming the
    fix, where the first stage would fail after writing its folder."""
    from eaglekit.targets.loading import load_tokenizer

    load_tokenizer(target, trust_remote_code=trust_remote_code)


def planned_drafter(train: Any, target_config: Any, aux_layers: tuple[int, ...]) -> Any | None:
    """The drafter config that `eaglekit train` (config: `TrainConfig`) will build for this target, without data
    (its type's `planned_config`); None where it cannot be told beforehand."""
    return registry.get(train.drafter_type).planned_config(train, target_config, aux_layers)


def check_export(formats: Iterable[str], drafter: Any, drafter_type: str) -> None:
    """What `eaglekit export --to FORMAT` refuses of this drafter config (of type `drafter_type`), for each format."""
    for fmt in formats:
        try:
            registry.get(drafter_type).check_exportable(drafter, fmt)
        except EaglekitError as error:
            raise EaglekitError(f"export --to {fmt}: {error} (or leave {fmt} out of export_formats)") from None


def _aux_layers(train: Any, layers: int) -> tuple[int, ...]:
    """The aux layers (input-of-layer) a fresh drafter fuses: train's `aux_layer_ids`, else the default."""
    from eaglekit.targets.extract import resolve_aux_ids

    return resolve_aux_ids(tuple(train.aux_layer_ids), "input_of_layer", layers, train.target)


def check_steps(steps: Iterable[Any], target: str, trust_remote_code: bool = False,
                bench_options: Callable[[Any], list[str]] | None = None) -> None:
    """Raise what a later stage of the plan (`eaglekit.pipeline.Step`s) would refuse; see the module docstring.
    `bench_options`: the bench stage's own option check, giving the methods it measures (the stages are the run's
    to know: this module imports none)."""
    from eaglekit.targets.capture import text_config
    from eaglekit.targets.loading import load_target_config

    configs = {step.name: step.make_config() for step in steps}
    target_config = load_target_config(target, trust_remote_code=trust_remote_code)
    if "extract" in configs and configs["extract"].backend == "vllm":
        try:
            check_capture(configs["extract"])
        except EaglekitError as error:
            raise _refused("extract", error, "") from None
    for name in (n for n in configs if n == "bench" or n.startswith("bench-")):  # bench-<type>: a further drafter's
        bench = configs[name]
        try:
            check_bench(bench, target_config, bench_options(bench) if bench_options else list(bench.methods))
        except EaglekitError as error:
            raise _refused(name, error) from None
    formats = [c.to for name, c in configs.items() if name.startswith("export-")]
    if formats and "train" in configs:
        layers = int(text_config(target_config).num_hidden_layers)
        drafter = planned_drafter(configs["train"], target_config, _aux_layers(configs["train"], layers))
        if drafter is not None:
            try:
                check_export(formats, drafter, configs["train"].drafter_type)
            except EaglekitError as error:
                raise _refused("export", error) from None
