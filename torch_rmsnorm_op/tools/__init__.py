"""Tools built on the library, never imported by it: the benchmarks, the correctness
campaign, the demo and its trace summary, the training examples and their small models.
``python -m torch_rmsnorm_op <command>`` runs them."""
