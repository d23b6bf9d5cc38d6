"""Drafter types, one folder each: `eagle3` (with its MLA and 3.1 variants), `p_eagle`, `dflash`; the draft
vocabulary every type shares (`vocab`)."""
