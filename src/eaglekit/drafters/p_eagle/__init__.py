"""P-EAGLE drafters: an EAGLE-3 drafter that drafts a whole chain in one forward: training (`train`) and drafting
(`decode`)."""
