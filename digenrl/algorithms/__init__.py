"""Sampling math (sde) and the GRPO objective (grpo); the math in words: docs/algorithms.md."""
