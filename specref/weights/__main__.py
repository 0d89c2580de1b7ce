"""`python -m specref.weights compact ...`: the command line is in cli.py."""
import sys

from .cli import main

sys.exit(main())
