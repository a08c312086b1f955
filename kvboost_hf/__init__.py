"""kvboost_hf."""

from kvboost_hf.attention import register_kvboost_attention

register_kvboost_attention()
