"""eaglekit's extract shards in the layout `speculators train` reads offline, for benchmarks/peer_speculators.py,
and a check that the soft labels speculators rebuilds from them are eaglekit's.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

LABEL_CHECK_TOKENS = 2048  # validation tokens on which eaglekit's and the peer's soft labels are compared


def final_norm_weight(target: str) -> torch.Tensor:
    """The target's final RMSNorm weight, read from its checkpoint (what speculators loads as verifier_norm)."""
    from eaglekit.training.target_weights import _checkpoint_tensors
    from eaglekit.targets.loading import resolve_target

    found = _checkpoint_tensors(Path(resolve_target(target)), ["model.norm.weight"])
    if not found:
        raise SystemExit(f"cannot read model.norm.weight from {resolve_target(target)}: speculators needs the target's final norm "
                         "in a local safetensors checkpoint")
    return found["model.norm.weight"].float()


def convert(trainer: Any, norm_weight: torch.Tensor, data: Path, hs_dtype: torch.dtype) -> dict[str, Any]:
    """eaglekit's train records, then its validation records, in speculators' offline layout."""
    import numpy as np
    from datasets import Dataset
    from safetensors.torch import save_file

    from eaglekit.training.data import split_indices

    source, config = trainer.source, trainer.config
    train_idx, val_idx = split_indices(len(source), config.val_fraction, config.split_seed)  # eaglekit's split, as its trainer makes it
    assert (train_idx, val_idx) == (trainer.train_idx, trainer.val_idx)
    if any(w.abs() < 1e-6 for w in norm_weight):
        raise SystemExit("the target's final norm has zero weights: the post-norm states eaglekit stores cannot be turned back")
    shutil.rmtree(data, ignore_errors=True)
    (data / "hidden_states").mkdir(parents=True)
    rows: dict[str, list[Any]] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for file_idx, i in enumerate(train_idx + val_idx):
        record = source.dataset[source.order[i]]
        cut = {k: record[k][: config.max_length] for k in ("input_ids", "loss_mask", "aux", "final")}
        t, h = cut["final"].shape
        # speculators computes lm_head(RMSNorm_w(last)); eaglekit stored y = RMSNorm_w(x). last = y / w gives x / rms(x),
        # whose rms is 1 (up to eps), so RMSNorm_w(last) = y again.
        last = cut["final"].float() / norm_weight
        states = torch.cat([cut["aux"].float().view(t, -1, h), last[:, None]], dim=1).to(hs_dtype)  # (T, 3 + 1, H)
        save_file({"hidden_states": states.contiguous(), "token_ids": cut["input_ids"].long()}, str(data / "hidden_states" / f"hs_{file_idx}.safetensors"))
        rows["input_ids"].append(cut["input_ids"].long().tolist())
        rows["loss_mask"].append(cut["loss_mask"].long().tolist())
        rows["seq_len"].append(t)
    dataset = Dataset.from_dict(rows)
    dataset.set_format(type="torch")
    dataset.save_to_disk(str(data))
    np.save(data / "d2t.npy", trainer.drafter.d2t.cpu().numpy())
    np.save(data / "t2d.npy", trainer.drafter.t2d.cpu().numpy())
    n_train, n_val = len(train_idx), len(val_idx)
    return {"train_records": n_train, "val_records": n_val, "train_tokens": sum(rows["seq_len"][:n_train]),
            "val_tokens": sum(rows["seq_len"][n_train:]), "train_lengths": rows["seq_len"][:n_train],
            "train_data_ratio": (n_train + 0.5) / (n_train + n_val),  # int(N * ratio) == n_train: the split falls between them
            "val_ids": [source.dataset.ids[source.order[i]] for i in val_idx], "hidden_states_dtype": str(hs_dtype).replace("torch.", "")}


def label_check(trainer: Any, data: Path, n_train: int, norm_weight: torch.Tensor, eps: float) -> dict[str, Any]:
    """Soft labels eaglekit trains on vs the ones speculators rebuilds from the converted files (validation tokens)."""
    from safetensors.torch import load_file

    from eaglekit.training.objective import soft_labels_from_hidden

    source, theirs, ours, scales, file_idx = trainer.source, [], [], [], n_train
    while sum(len(x) for x in ours) < LABEL_CHECK_TOKENS and (data / "hidden_states" / f"hs_{file_idx}.safetensors").is_file():
        last = load_file(str(data / "hidden_states" / f"hs_{file_idx}.safetensors"))["hidden_states"][:, -1].float()
        rms = last.pow(2).mean(-1, keepdim=True).add(eps).sqrt()
        theirs.append(last / rms * norm_weight)  # LlamaRMSNorm, as speculators' verifier_norm computes it
        scales.append(rms.flatten())
        ours.append(source.dataset[source.order[trainer.val_idx[file_idx - n_train]]]["final"][: len(last)].float())
        file_idx += 1
    weight, t2d = source.lm_head_weight.float().cpu(), source.t2d.cpu()
    p, _ = soft_labels_from_hidden(torch.cat(ours)[None], weight, t2d)
    q, _ = soft_labels_from_hidden(torch.cat(theirs)[None], weight, t2d)
    kl = (p * (p.clamp_min(1e-30).log() - q.clamp_min(1e-30).log())).sum(-1)
    scale = torch.cat(scales)
    return {"tokens": int(p.shape[1]), "argmax_agreement": float((p.argmax(-1) == q.argmax(-1)).float().mean()),
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "rms_of_stored_last_min": float(scale.min()),
            "rms_of_stored_last_max": float(scale.max())}
