"""DFlash drafters (block diffusion): the model (`model`), training blocks and loss (`train`, `setup`), drafting
(`decode`, `static`) and the engines' layouts (`formats`)."""
