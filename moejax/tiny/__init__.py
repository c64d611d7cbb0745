"""Random-weight models of every registered family (tiny ones and real shapes), for demos, tests
and benchmarks: checkpoints written with NumPy or transformers, or weights made on the device. Not trained."""
