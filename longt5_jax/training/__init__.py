"""Training: the loop, the sharded step, optimizer, loss, checkpoints, metrics and the
multi-process start-up."""
