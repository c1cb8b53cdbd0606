"""`python -m longt5_jax.doctor`: will this run work here? One row per check, before a job.

Software against the tested versions, the devices, the config (parses and builds, the mesh
fits, the planner's memory estimate against device memory), the attention path and (where it
is the fused kernels) one tiny layer checked against XLA's attention on this device, storage
(MODEL_DIR, free space, the caches, the tokenizer and data), the environment (XLA_FLAGS,
JAX_PLATFORMS, the metrics port) and, with several processes, shared storage and one
collective over every device. It writes nothing but a token it removes and never creates a run.
"""
