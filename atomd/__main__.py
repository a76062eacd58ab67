import sys

from atomd.cli import main

sys.exit(main())
