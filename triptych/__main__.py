import sys

from triptych.cli import main

sys.exit(main())
