"""Sampling math (sde) and the GRPO objective (grpo)."""
