"""Where a block drafter (DFlash, DSpark) loses its drafts: the decoder's acceptance per position against the training
forward's on the same tokens.

    python benchmarks/block_probe.py --target T --drafter D --prompts P.jsonl --out X.json   # one drafter or more
    python benchmarks/block_probe.py --work runs/drafters --out X.json    # run_all's variants (variant-<type>/train)

For each drafter, on the bench's prompts at T=0 (chain of max drafts, the target's EOS ends an answer):
- `decoded`: the decoder's own steps (eager backend, and `--backend static` with compile on CUDA as bench runs it):
  acceptance per position given the position before (`conditional`) and tau;
- `teacher_forced_at_decode_anchors`: the training forward (`eaglekit.drafters.dflash.train`'s blocks, masks and
  positions; DSpark's Markov head fed the true previous tokens) over prompt + the decoded answer, with the target's
  aux states captured as extract captures them, at the decoder's own block starts. At T=0 it must accept what the
  decoder accepted (`agree`: the share of steps where it does; below 1 only by rounding of near-ties);
- `teacher_forced_all_anchors`: the same forward at every position of the answers: what the drafter gives this text
  whatever the step boundaries;
- `validation`: the drafter's train manifest (accuracy per position; DSpark's calibration: blocks surviving each
  position on the validation split), the text it was trained to.
A gap between `decoded` and `teacher_forced_at_decode_anchors` is the decoder's; one between those and `validation`
is the text's (these prompts against the training data).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from eaglekit import registry  # noqa: E402
from eaglekit.decode import DecodeStats, Decoder, drafter_aux_layers  # noqa: E402
from eaglekit.drafters.dflash.train import block_attention_mask, block_input_ids, block_positions  # noqa: E402
from eaglekit.drafters.dspark.train import block_tokens  # noqa: E402
from eaglekit.targets.capture import HiddenStateCapture, forward_target  # noqa: E402
from reference_summary import conditional  # noqa: E402


def summary(accepted: list[int], k: int) -> dict[str, Any]:
    """Accepted drafts per step -> tau, acceptance per position and the same given the position before."""
    stats = DecodeStats(accepted=accepted, max_drafts=k)
    acceptance = stats.acceptance_per_position()
    return {"steps": len(accepted), "tau": stats.tau, "acceptance": acceptance, "conditional": conditional(acceptance)}


def step_starts(prompt_length: int, accepted: list[int]) -> list[int]:
    """The position of each decode step's bonus token (its block's first slot)."""
    return [prompt_length + sum(a + 1 for a in accepted[:j]) for j in range(len(accepted))]


def num_drafts(drafter: torch.nn.Module) -> tuple[int, int]:
    """-> (the block slot of the first draft, drafts per block): DSpark's layout, DFlash's slot 1 onwards."""
    config = drafter.config
    first = getattr(config, "first_slot", 1)
    return first, config.block_size - first


@torch.inference_mode()
def block_drafts(
    drafter: torch.nn.Module,
    aux: torch.Tensor,  # (1, T, n_aux * H_t) the target's aux states of the whole sequence
    ids: torch.Tensor,  # (1, T)
    anchors: torch.Tensor,  # (1, N) block starts (the bonus token's position)
    prev: torch.Tensor | None = None,  # (1, N, K) the Markov head's previous tokens; default the true ones
) -> torch.Tensor:
    """The training forward's greedy drafts -> (N, K) target ids (blocks of `eaglekit.drafters.dflash.train`)."""
    config, t = drafter.config, ids.shape[1]
    first, k = num_drafts(drafter)
    size = config.block_size
    context = drafter.context(aux, torch.arange(t, device=ids.device)[None])
    block = block_input_ids(ids, anchors, size, config.mask_token_id)
    hidden = drafter.hidden_states(block, block_positions(anchors, size), context,
                                   block_attention_mask(anchors, t, size))
    hidden = hidden.view(1, anchors.shape[1], size, -1)[:, :, first:]  # (1, N, K, H)
    if hasattr(drafter, "markov_logits"):
        logits, _ = drafter.markov_logits(hidden, block_tokens(ids, anchors, size, k, 0) if prev is None else prev)
    else:
        logits = drafter.lm_head(hidden)
    return drafter.draft_to_target(logits.argmax(-1))[0]


def accepted_lengths(drafts: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor) -> list[int]:
    """drafts (N, K) at anchors (N,) against the sequence ids (T,) -> the accepted prefix length of each block."""
    k = drafts.shape[1]
    truth = ids[anchors[:, None] + 1 + torch.arange(k, device=ids.device)]  # (N, K)
    return (drafts == truth).long().cumprod(1).sum(1).tolist()


@torch.inference_mode()
def capture_aux(target: torch.nn.Module, ids: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    with HiddenStateCapture(target, layers, capture_final=False) as capture:
        forward_target(target, ids)
        return capture.aux()


def probe(target, drafter, prompts: list[list[int]], max_new_tokens: int, eos: tuple[int, ...],
          backends: list[str], compile: bool) -> dict[str, Any]:
    _, k = num_drafts(drafter)
    method = registry.of(drafter).methods[0]
    device = next(target.parameters()).device
    longest = max(map(len, prompts)) + max_new_tokens + k + 2
    decoded: dict[str, list[int]] = {}
    at_steps, everywhere, agree = [], [], []
    for backend in backends:
        decoder = Decoder(target, drafter, backend, compile and backend == "static", max_length=longest)
        steps: list[int] = []
        for prompt in prompts:
            result = decoder.generate(prompt, max_new_tokens, method=method, chain_length=k, eos_token_ids=eos)
            steps += result.stats.accepted
            if backend != backends[0]:
                continue
            ids = torch.tensor(prompt + result.tokens, device=device)
            starts = torch.tensor(step_starts(len(prompt), result.stats.accepted), device=device)
            room = starts + k < len(ids)  # steps whose whole block lies inside the decoded text
            aux = capture_aux(target, ids[None], drafter_aux_layers(drafter))
            if room.any():
                forced = accepted_lengths(block_drafts(drafter, aux, ids[None], starts[room][None]), ids, starts[room])
                at_steps += forced
                agree += [f == d for f, d in zip(forced, torch.tensor(result.stats.accepted)[room.cpu()].tolist())]
            every = torch.arange(len(prompt), max(len(prompt), len(ids) - k), device=device)  # none in a short answer
            if len(every):
                everywhere += accepted_lengths(block_drafts(drafter, aux, ids[None], every[None]), ids, every)
        decoded[backend] = steps
    return {"method": method, "drafts": k,
            "decoded": {backend: summary(steps, k) for backend, steps in decoded.items()},
            "teacher_forced_at_decode_anchors": {**summary(at_steps, k), "agree": sum(agree) / max(len(agree), 1)},
            "teacher_forced_all_anchors": summary(everywhere, k)}


def validation(drafter_dir: Path) -> dict[str, Any]:
    manifest = json.loads((drafter_dir / "manifest.json").read_text())
    found: dict[str, Any] = {"accuracy": manifest.get("val", {}).get("acc_k")}
    positions = manifest.get("after_training", {}).get("positions")
    if positions:  # blocks whose drafts match the target's greedy tokens up to each position
        survived = [p["survived"] for p in positions]
        found["calibration_conditional"] = [s / max(before, 1) for s, before in
                                            zip(survived, [positions[0]["blocks"]] + survived[:-1])]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="", help="run_all's work folder: its target, prompts and variants")
    parser.add_argument("--target", default="")
    parser.add_argument("--drafter", action="append", default=[])
    parser.add_argument("--prompts", default="")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--backend", action="append", default=[], help="eager (always first), static")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp16", "fp32"),
                        help="the target's and drafters' dtype (auto: bf16 on CUDA, as bench runs them)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if not args.work and not (args.target and args.drafter and args.prompts):
        parser.error("pass --work (run_all's work folder), or --target, --drafter and --prompts")
    from eaglekit.data import prompt_messages, read_conversations
    from eaglekit.decode.setup import eos_ids, load_drafter, prompt_ids
    from eaglekit.manifest import atomic_write_json, environment
    from eaglekit.runtime import resolve_device, resolve_dtype
    from eaglekit.targets.loading import load_target, load_tokenizer

    work = Path(args.work) if args.work else None
    target_path = args.target or str(work / "models" / "reference_target")
    prompts_path = args.prompts or str(work / "models" / "tiny_prompts_eval.jsonl")
    drafters = args.drafter or [str(p) for p in sorted(work.glob("variant-*/train")) if (p / "config.json").exists()]
    device = resolve_device("auto")
    dtype = resolve_dtype(args.dtype, device)
    target = load_target(target_path, device, dtype)
    tokenizer = load_tokenizer(target_path)
    prompts = [prompt_ids(tokenizer, prompt_messages(c)) for c in read_conversations(prompts_path)][: args.num_prompts]
    backends = ["eager"] + [b for b in args.backend if b != "eager"]
    result: dict[str, Any] = {"benchmark": "block_probe", "target": target_path, "prompts": prompts_path,
                              "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "temperature": 0,
                              "dtype": str(dtype), "environment": environment(), "drafters": {}}
    for path in drafters:
        drafter = load_drafter(path, target, device, dtype)
        found = probe(target, drafter, prompts, args.max_new_tokens, eos_ids(tokenizer, target), backends,
                      device.type == "cuda")
        found["validation"] = validation(Path(path))
        result["drafters"][path] = found
        atomic_write_json(Path(args.out), result)
        print(json.dumps({path: found}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
