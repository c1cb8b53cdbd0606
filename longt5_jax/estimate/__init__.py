"""Planning for a cluster: compile targets, compile-ahead, reading the compiled program, the cost
and communication models, candidates and the planner (`python -m longt5_jax.plan`)."""
