import sys

from warmstart.cli import main

sys.exit(main())
