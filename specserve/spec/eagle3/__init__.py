"""EAGLE-3: a one-layer head that drafts from the target's own hidden states (head.py: the module, its
speculators-format checkpoints and its reference forward)."""
