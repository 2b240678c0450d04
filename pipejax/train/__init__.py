"""The trainer: a config in, a trained, checkpointed and evaluated run out (scripts/train.py)."""
