"""Calibrating a DSpark drafter's confidence head after training: the DSpark paper's sequential temperature scaling,
and how well the raw and calibrated confidences predict survival (per drafted position: ECE and AUC).

What is predicted. At T = 1, draft k is accepted with probability a_k = 1 - TV(q_k, p_k) given that its prefix was
(`verify.sampled_chain_path`'s rule), so a block's drafts survive to position k with probability prod_{i<=k} a_i. On
the validation split (teacher-forced, as training) every counted block position gives the raw confidence logit z_k and
a_k; one seeded Bernoulli draw per position turns the a_k into acceptance events, their running product into the
survival label s_k of the block at position k. The prediction of s_k is the survival prod_{i<=k} sigmoid(z_i / T_i).

Sequential temperature scaling (the DSpark paper, "post-hoc calibration"): for k = 0, 1, ... in turn, T_k is the
value of a log-spaced grid (0.05 .. 20) that minimises the ECE of the predicted survival at position k, with
T_0 .. T_{k-1} already fixed. A temperature rescales a logit without changing its order, so the head's ranking of
blocks at one position is kept. ECE: 10 equal-width bins of the prediction, the count-weighted mean of |mean
prediction - mean label|. AUC: the probability that a surviving block is predicted higher than a failed one (ties
half), None where one class is empty. DeepSpec ships no calibration and vLLM uses the raw head: eaglekit stores the
temperatures in the drafter (`DSparkConfig.confidence_temperatures`) and applies them in `DSparkDrafter.calibrated`.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

from eaglekit.drafters.dspark.train import DSparkObjective, block_outputs

log = logging.getLogger(__name__)
GRID = torch.logspace(-1.301, 1.301, 241).tolist()  # temperatures 0.05 .. 20, about 2% apart
BINS = 10
SEED = 0  # the acceptance draws


def expected_calibration_error(prediction: torch.Tensor, label: torch.Tensor, bins: int = BINS) -> float:
    """prediction (N,) in [0, 1], label (N,) in {0, 1} -> ECE over `bins` equal-width bins."""
    index = (prediction * bins).long().clamp(max=bins - 1)  # (N,)
    count = torch.bincount(index, minlength=bins).double()
    mean_prediction = torch.bincount(index, prediction.double(), minlength=bins) / count.clamp(min=1)
    mean_label = torch.bincount(index, label.double(), minlength=bins) / count.clamp(min=1)
    return float((count * (mean_prediction - mean_label).abs()).sum() / count.sum().clamp(min=1))


def auc(prediction: torch.Tensor, label: torch.Tensor) -> float | None:
    """The area under the ROC curve of `prediction` for the binary `label` (Mann-Whitney on average ranks, so ties
    count half), None where one class is empty."""
    positives = int(label.sum())
    negatives = label.numel() - positives
    if positives == 0 or negatives == 0:
        return None
    order = torch.argsort(prediction)
    _, inverse, counts = torch.unique(prediction[order], return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    average = ends - (counts.double() - 1) / 2  # the mean of the 1-based ranks a tie group spans
    ranks = torch.empty(label.numel(), dtype=torch.float64)
    ranks[order] = average[inverse]
    return float((ranks[label.bool()].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def survival_labels(accept: torch.Tensor, counted: torch.Tensor, seed: int = SEED) -> torch.Tensor:
    """accept (N, K) acceptance probabilities, counted (N, K) bool (a contiguous prefix per block) -> (N, K) survival
    labels: the running product of one seeded Bernoulli draw per position."""
    draws = torch.rand(accept.shape, generator=torch.Generator().manual_seed(seed)) < accept.cpu().float()
    return (draws & counted.cpu()).long().cumprod(1).bool()


def predicted_survival(logits: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """logits (N, K), one temperature per position (1 beyond the list) -> (N, K) prod_{i<=k} sigmoid(z_i / T_i)."""
    k = logits.shape[1]
    scale = torch.tensor([temperatures[i] if i < len(temperatures) else 1.0 for i in range(k)], dtype=logits.dtype)
    return torch.cumprod(torch.sigmoid(logits / scale), 1)


def fit_temperatures(logits: torch.Tensor, labels: torch.Tensor, counted: torch.Tensor) -> list[float]:
    """Sequential temperature scaling (module docstring) -> one temperature per position."""
    temperatures: list[float] = []
    for k in range(logits.shape[1]):
        rows = counted[:, k]
        if not bool(rows.any()):
            temperatures.append(temperatures[-1] if temperatures else 1.0)
            continue
        errors = [expected_calibration_error(predicted_survival(logits[rows, : k + 1], temperatures + [t])[:, k],
                                             labels[rows, k]) for t in GRID]
        temperatures.append(GRID[min(range(len(GRID)), key=errors.__getitem__)])
    return temperatures


def report(logits: torch.Tensor, labels: torch.Tensor, counted: torch.Tensor,
           temperatures: list[float]) -> list[dict[str, Any]]:
    """Per position: blocks counted, survivals, raw and calibrated ECE and AUC, the temperature."""
    raw, calibrated = predicted_survival(logits, []), predicted_survival(logits, temperatures)
    found = []
    for k in range(logits.shape[1]):
        rows = counted[:, k]
        label = labels[rows, k]
        found.append({"position": k + 1, "blocks": int(rows.sum()), "survived": int(label.sum()),
                      "temperature": temperatures[k],
                      "ece_raw": expected_calibration_error(raw[rows, k], label), "auc_raw": auc(raw[rows, k], label),
                      "ece": expected_calibration_error(calibrated[rows, k], label),
                      "auc": auc(calibrated[rows, k], label)})
    return found


@torch.no_grad()
def collect(drafter: Any, batches: Iterable[Any], num_anchors: int, seed: int) -> tuple[torch.Tensor, ...]:
    """The validation split's blocks (anchors drawn as training draws them) -> (raw confidence logits (N, K),
    acceptance probabilities 1 - TV (N, K), counted (N, K) bool)."""
    objective = DSparkObjective(drafter, num_anchors, 1.0, "sdpa", seed)
    logits, accept, counted = [], [], []
    for batch in batches:
        anchors, valid = objective.anchors(batch.loss_mask, batch.in_vocab)
        out = block_outputs(drafter, batch.aux, batch.input_ids, batch.loss_mask, batch.probs, batch.in_vocab,
                            anchors, valid)
        tv = 0.5 * (torch.softmax(out.logits.float(), -1) - out.labels.float()).abs().sum(-1)  # (B, N, K)
        k = tv.shape[-1]
        logits.append(out.confidence.float().reshape(-1, k).cpu())
        accept.append((1.0 - tv).clamp(0.0, 1.0).reshape(-1, k).cpu())
        counted.append(out.accuracy.permute(1, 2, 0).reshape(-1, k).cpu())
    if not logits:  # no validation split (val_fraction=0)
        k = drafter.config.max_drafts
        return torch.zeros(0, k), torch.zeros(0, k), torch.zeros(0, k, dtype=torch.bool)
    return torch.cat(logits), torch.cat(accept), torch.cat(counted)


def calibrate(drafter: Any, batches: Iterable[Any], num_anchors: int, seed: int) -> dict[str, Any]:
    """Fit the temperatures on the validation batches, store them in the drafter's config -> the calibration report
    (`positions`: per position; the training manifest keeps it, the run report shows it)."""
    if not drafter.config.confidence_head:
        return {}
    logits, accept, counted = collect(drafter, batches, num_anchors, seed)
    keep = counted.any(1)
    logits, accept, counted = logits[keep], accept[keep], counted[keep]
    if logits.shape[0] == 0:
        log.warning("no validation blocks: the DSpark confidence head stays uncalibrated (raw); raise val_fraction")
        return {"calibrated": False, "reason": "no validation blocks"}
    labels = survival_labels(accept, counted)
    temperatures = fit_temperatures(logits, labels, counted)
    drafter.with_temperatures(tuple(temperatures))
    positions = report(logits, labels, counted, temperatures)
    log.info("DSpark confidence calibrated on %d validation blocks: ECE per position %s (raw %s)", logits.shape[0],
             ", ".join(f"{p['ece']:.3f}" for p in positions), ", ".join(f"{p['ece_raw']:.3f}" for p in positions))
    return {"calibrated": True, "blocks": int(logits.shape[0]), "temperatures": temperatures, "positions": positions}
