"""Data-parallel attention + expert-parallel MoE on one device mesh."""
