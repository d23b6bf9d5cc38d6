"""The options of `scripts/build_tiny_target.py` (`BuildConfig`), in a module of their own so that the build and the
training loop it calls (`tiny_target_training.py`) both read them without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

from eaglekit.config import option


@dataclass(frozen=True)
class BuildConfig:
    output: str = option("src/eaglekit/assets", "directory that receives tiny_target/ and tiny_prompts*.jsonl")
    minutes: float = option(5.5, "wall-clock training budget in minutes")
    steps: int = option(0, "train exactly this many optimiser steps instead (reproducible on a busy machine); 0 = use minutes")
    seed: int = option(0, "seed for data order, initialisation and prompt selection")
    threads: int = option(2, "torch CPU threads")
    vocab_size: int = option(4096, "BPE vocabulary size (special tokens included)")
    hidden_size: int = option(128, "model width")
    num_layers: int = option(8, "decoder layers (8 gives EAGLE-3 aux layers 2, 4, 5)")
    num_heads: int = option(4, "attention heads")
    num_kv_heads: int = option(2, "key/value heads (grouped-query attention)")
    intermediate_size: int = option(384, "MLP width")
    max_positions: int = option(1024, "max_position_embeddings")
    seq_len: int = option(256, "training window in tokens")
    batch_size: int = option(4, "windows per optimiser step")
    lr: float = option(4e-3, "peak AdamW learning rate (cosine decay over the wall budget)")
    warmup_steps: int = option(20, "linear warm-up steps")
    num_prompts: int = option(200, "records in tiny_prompts.jsonl")
    num_eval: int = option(30, "records in tiny_prompts_eval.jsonl")
    dtype: str = option("bfloat16", "dtype of the saved weights", choices=("bfloat16", "float32"))
    device: str = option("cpu", "training device: cpu, cuda or auto (CUDA trains under bf16 autocast)")
    compile: bool = option(False, "torch.compile the training step (worth it on a GPU)")
    corpus: str = option("stdlib", "training text: the stdlib alone, or the stdlib plus installed site-packages",
                         choices=("stdlib", "stdlib+site-packages"))
    corpus_mb: float = option(0.0, "cap on the corpus size in MB, files taken in a fixed hashed order (0 = no cap)")
    name: str = option("tiny_target", "name of the model directory written under output")
    tokenizer: str = option("", "reuse this model directory's tokenizer instead of training one (a draft LM for a target)")
