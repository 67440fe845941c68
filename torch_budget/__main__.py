"""`python -m torch_budget <command>`: the same as the `torch-budget` console script."""
import sys

from torch_budget.cli import main

sys.exit(main())
