"""kvboost_hf."""
