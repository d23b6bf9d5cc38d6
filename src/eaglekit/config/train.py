"""The options of a drafter training run: one frozen dataclass, the single source of their defaults and help.

`eaglekit.stages.train.Config` is this class (the CLI builds it from YAML and `key=value`);
`eaglekit.training.loop.train(config)` and the setup it calls read it. A module of its own, outside the torch-importing
`eaglekit.drafters.eagle3` package, so that `eaglekit train --help` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from eaglekit import registry
from eaglekit.config import option

DRAFTER_TYPES = registry.names()  # `drafter_type=`; saved in each drafter's config.json
TWO_NUMBERS = (lambda betas: len(betas) == 2, "two numbers")  # AdamW's (beta1, beta2)
BLOCK_SIZE = (lambda size: size == 0 or size >= 2, "0 (the type's default) or at least 2")


@dataclass(frozen=True)
class TrainConfig:
    """Every option of a training run (`eaglekit train KEY=VALUE ...`); the defaults are the CLI's."""

    RENAMED: ClassVar[dict[str, str]] = {"aux_layers": "aux_layer_ids"}  # old key -> new (refused, naming the new)

    drafter_type: str = option("eagle3", "what to train: " + "; ".join(f"{name} ({registry.get(name).summary})"
                                                                     for name in DRAFTER_TYPES),
                               choices=DRAFTER_TYPES)
    target: str = option("", "target model (path, hub id or 'tiny'): config, embedding, lm_head (and the "
                             "model itself online)")
    shards: str = option("", "offline mode: an `extract` output directory")
    data: tuple[str, ...] = option((), "online mode: conversation files; the target runs in-process")
    skip_errors: bool = option(False, "online mode: skip malformed records of data (counted) instead of stopping")
    output: str = option("", "output directory")
    vocab: str = option("", "vocab.safetensors (or its directory); empty = the init_from drafter's, "
                            "else built from the data")
    draft_vocab_size: int = option(32000, "draft vocabulary size when it is built here", min=1)
    init_from: str = option("", "start from a drafter (eaglekit format; EAGLE/SGLang/vLLM/speculators "
                                "via eaglekit.doctor)")
    rebuild_vocab: bool = option(False,
                                 "with init_from and a different vocab: remap lm_head rows to it instead of refusing")
    lm_head_init: str = option("target",
                               "a fresh drafter's lm_head: target = the target's lm_head rows of the draft vocabulary "
                               "(the logits the drafter learns to match), random", choices=("target", "random"))
    freeze_lm_head: bool = option(False,
                                  "keep lm_head fixed while training (speculators' choice; with lm_head_init=target)")
    init_std: float = option(0.0, "a fresh drafter's linear layers: 0 = torch's default init (uniform, "
                             "std 1/sqrt(3 fan_in)); > 0 = normal with this std (Hugging Face's scheme, "
                             "speculators' drafters: 0.02)", min=0)
    norm_before_fc: bool = option(False, "a fresh drafter: one RMSNorm over the concatenated aux states before fc "
                                  "(speculators' default; exclusive with fc_norm)")
    fc_norm: bool = option(False, "a fresh drafter: one RMSNorm per aux state before fc (EAGLE 3.1 with norm_output)")
    norm_output: bool = option(False, "a fresh drafter: each drafting step hands the next the post-norm hidden state "
                               "(EAGLE 3.1)")
    drafter_arch: str = option("llama", "a fresh drafter's midlayer: llama (q/k/v attention), or mla (DeepSeek latent "
                               "attention, what DeepSeek-V3/Kimi-K2 deployments serve; its dims "
                               "below, 0 = the target's)",
                               choices=("llama", "mla"))
    q_lora_rank: int = option(0, "drafter_arch=mla: query latent rank (0 = the MLA target's)", min=0)
    kv_lora_rank: int = option(0, "drafter_arch=mla: key/value latent rank (0 = the MLA target's)", min=0)
    qk_nope_head_dim: int = option(0, "drafter_arch=mla: per-head query/key dims without RoPE (0 = the MLA target's)",
                                   min=0)
    qk_rope_head_dim: int = option(0, "drafter_arch=mla: per-head query/key dims with RoPE (0 = the MLA target's)",
                                   min=0)
    v_head_dim: int = option(0, "drafter_arch=mla: per-head value dims (0 = the MLA target's)", min=0)
    aux_layer_ids: tuple[int, ...] = option((), "target layers fed to fc, input-of-layer ids (as extract's); empty = "
                                            "init_from's, else (2, L//2, L-3), distinct ones under 7 layers", min=0)
    mask_token_id: int = option(-1, "p-eagle, dflash, dspark: the token id the drafted (mask) positions read; -1 = "
                                "init_from's, else p-eagle: the target's last vocabulary id, dflash and dspark: the "
                                "tokenizer's mask, else pad, else end-of-sequence token", min=-1)
    ttt_steps: int = option(7, "training-time-test steps K (eagle3); drafted positions trained per anchor (p-eagle: "
                            "the first from the target's states, the rest from mask_hidden; serve k <= this)", min=1)
    step_decay: float = option(0.8, "loss weight of TTT step k is step_decay**k (dflash, dspark: of drafted position "
                               "k+1; the DFlash paper's exp(-1/7) = 0.87 at block_size 16, DeepSpec's exp(-1/4) = "
                               "0.78)", above=0)
    block_size: int = option(0, "dflash, dspark: tokens per block, the bonus token then mask tokens (dflash serves "
                             "k <= block_size - 1 drafts, dspark k <= block_size); 0 = init_from's, else the type's "
                             "published default: dflash 16, dspark 7", check=BLOCK_SIZE)
    draft_layers: int = option(5, "dflash, dspark: decoder layers of a fresh drafter (the published 8B drafters: 5)",
                               min=1)
    target_layer_ids: tuple[int, ...] = option((), "dflash, dspark: target layers whose states are the drafter's "
                                               "context, "
                                               "OUTPUT-of-layer ids (vLLM's DFlash convention; extract them with "
                                               "aux_layer_ids = these + 1); empty = init_from's, else the store's "
                                               "(offline), else spread from 1 to L-3, one per drafter layer", min=0)
    num_anchors: int = option(64, "dflash, dspark: blocks sampled per sequence and batch (anchor positions in the "
                              "answers)", min=1)
    markov_rank: int = option(256, "dspark: rank r of the Markov head, the logit bias W2 . W1[previous token] "
                              "(0 = none: a DFlash drafter in DSpark's layout)", min=0)
    markov_head_type: str = option("vanilla", "dspark: the Markov head (vanilla: W2 . W1[x]; gated: a gate from the "
                                   "hidden state and W1[x]; rnn: a state carried across the block); vLLM 0.32 serves "
                                   "vanilla", choices=("vanilla", "gated", "rnn"))
    confidence_head: bool = option(True, "dspark: a confidence head (the probability that a draft survives given its "
                                   "prefix did), calibrated per position after training")
    confidence_head_with_markov: bool = option(True, "dspark: the confidence head also reads W1[previous token]")
    sample_from_anchor: bool = option(True, "dspark: every block slot drafts (the anchor's slot drafts the next "
                                      "token: DeepSpec's layout); false: DFlash's fill-in layout")
    epochs: int = option(1, "passes over the training split", min=1)
    max_steps: int = option(0, "optimizer steps to run, over as many epochs as that takes (0 = `epochs` decides)",
                            min=0)
    batch_size: int = option(4, "sequences per micro-batch per process", min=1)
    grad_accum: int = option(1, "micro-batches per optimizer step", min=1)
    max_length: int = option(2048, "tokens per sequence (longer ones are truncated)", min=1)
    pad_to_multiple: int = option(0,
                                  "pad each micro-batch's length up to a multiple of this, so compiled kernels see few "
                                  "shapes (padding is masked: same loss); 0 = auto: 128 on CUDA, 1 elsewhere", min=0)
    lr: float = option(1e-4, "peak learning rate (AdamW)", above=0)
    betas: tuple[float, ...] = option((0.9, 0.999),
                                      "AdamW betas (0.9, 0.95) in EAGLE's reference; 0.999 trained a better drafter "
                                      "on the reference target (benchmarks/README.md)",
                                      min=0, below=1, check=TWO_NUMBERS)
    weight_decay: float = option(0.0, "AdamW weight decay", min=0)
    warmup_steps: int = option(-1, "linear warmup steps; -1 = 3% of the total", min=-1)
    min_lr_ratio: float = option(0.0, "cosine decays to lr * min_lr_ratio", min=0, max=1)
    grad_clip: float = option(1.0, "gradient norm clip (0 = off)", min=0)
    step_weighting: str = option("tokens",
                                 "tokens: a step's loss is the sum over its loss tokens divided by the mean count "
                                 "per step (every token weighs the same, as in packed training); equal: the mean over "
                                 "its own loss tokens (every step weighs the same)", choices=("tokens", "equal"))
    val_fraction: float = option(0.05, "share of records held out for validation (0 = none)", min=0, below=1)
    val_every: int = option(0, "validate every N optimizer steps (0 = at each epoch end only)", min=0)
    save_every: int = option(500, "checkpoint every N optimizer steps (and at each epoch end; 0 = at epoch ends "
                             "only)", min=0)
    keep_checkpoints: int = option(2, "checkpoints kept on disk", min=1)
    resume: bool = option(False, "continue from the latest checkpoint in output")
    overwrite: bool = option(False, "write into an output directory that is not empty and was not written by train")
    log_every: int = option(10, "train metrics line every N optimizer steps", min=1)
    seed: int = option(0, "seed for initialisation and data order", min=0)
    split_seed: int = option(0, "seed of the train/validation split (kept apart from `seed`, so runs "
                             "that differ in seed are validated on the same records)", min=0)
    device: str = option("auto", "auto, cpu, cuda, cuda:N (torchrun: the local rank's GPU)")
    device_map: str = option("", "online mode, one process: spread a target too large for one GPU over the GPUs "
                             "(e.g. auto, passed to from_pretrained); its states are moved to `device` for the drafter")
    dtype: str = option("auto", "autocast dtype: auto = bf16 on CUDA, fp32 on CPU",
                        choices=("auto", "bf16", "fp16", "fp32"))
    attention: str = option("auto",
                            "TTT attention: sdpa (boolean mask), flex (block mask, compiled on CUDA), auto = sdpa",
                            choices=("auto", "sdpa", "flex"))
    compile: bool = option(False, "torch.compile the TTT forward")
    distributed: str = option("ddp", "under torchrun: ddp, or fsdp (FSDP2 fully_shard) for large drafters",
                              choices=("ddp", "fsdp"))
    chat_template: str = option("", "online mode: chat template (Jinja string or file) overriding the tokenizer's")
    trust_remote_code: bool = option(False, "allow the target's custom code")
