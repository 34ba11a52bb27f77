"""`python -m kvpool` is the `kvpool` command."""

import sys

from .cli import main

sys.exit(main())
