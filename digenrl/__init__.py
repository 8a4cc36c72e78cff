"""DigenRL: online RL post-training for diffusion / flow-matching generators on disaggregated hardware."""

__version__ = "0.1.0"
