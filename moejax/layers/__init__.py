"""Flax building blocks. Parameter names and layouts follow the HF checkpoint
(``weight`` of shape [out, in]) so the loader's name table stays a plain rename."""
