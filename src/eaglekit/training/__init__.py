"""Training a drafter, whatever its type: the loop (`loop`: optimiser, schedule, validation, resume, DDP/FSDP),
the data sources (`data`), checkpoints (`checkpoint`) and the run's setup (`setup`)."""
