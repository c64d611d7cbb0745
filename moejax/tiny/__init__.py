"""Random-weight models of every registered family (tiny ones and real shapes), for demos, tests and
benchmarks: checkpoints written with NumPy or transformers (weights made on the device instead:
moejax/model.py random_model). Not trained."""
