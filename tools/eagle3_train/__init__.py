"""The phases of tools/train_eagle.py: prompts, the target's answers, the target's features."""
