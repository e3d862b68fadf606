"""Example transform chains for `prep cache --pipeline` (a PIPELINE.py and its bundle-config twin)."""
