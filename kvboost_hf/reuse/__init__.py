"""Stages 4-5: what a prompt can reuse and how stitched K/V are made right: the reuse plan (:mod:`.plan`), key
re-rotation (:mod:`.rope`) and repair of approximate hits (:mod:`.repair`). No tensors of a cache are touched here
except through explicit arguments."""
