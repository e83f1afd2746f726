import sys

from flexdispatch.cli import main

sys.exit(main())
