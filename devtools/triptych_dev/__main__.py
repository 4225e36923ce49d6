import sys

from triptych_dev.cli import main

sys.exit(main())
