"""Command-line utilities (``python -m kvboost_hf.tools.NAME``)."""
