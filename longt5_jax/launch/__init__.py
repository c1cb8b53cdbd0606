"""Launchers: `python -m longt5_jax.launch.local` runs N training processes on this machine."""
