"""Parallelism as a plan separate from the model: mesh, the logical-axis rule table, sharding."""
