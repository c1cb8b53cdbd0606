"""python -m longt5_jax.plan: see `planner.py`."""

import sys

from longt5_jax.plan.planner import main

if __name__ == "__main__":
    sys.exit(main())
