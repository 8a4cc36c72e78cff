"""Prompt sets: the rows a run samples prompts from."""
