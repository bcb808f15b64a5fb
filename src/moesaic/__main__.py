import sys

from moesaic.cli import main

sys.exit(main())
