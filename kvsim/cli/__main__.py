import sys

from kvsim.cli.app import main

sys.exit(main())
