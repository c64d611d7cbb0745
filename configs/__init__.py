"""Parallel layouts shipped with moejax (installed as ``moejax.configs``; see pyproject.toml).

``dp{N}-ep{N}`` layouts need no file (moejax.parallel.config generates them); the YAML files
here are the named ones, e.g. ``dp8-ep8-eplb.yaml``, the example that documents every field.
"""
