"""Offline: teach the model a config's labelled questions (choice and series heads, LoRA) from recorded bars."""
