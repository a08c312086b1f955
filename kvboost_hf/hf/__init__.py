"""Stages 6-8, the Hugging Face side: the drop-in cache (:mod:`.cache`), the adapter that lets ``generate()`` drive
it (:mod:`.hooks`), generation helpers (:mod:`.generation`), the ``"kvboost"`` attention (:mod:`.attention`) and
model loading and support checks (:mod:`.models`)."""
