import sys

from .subcommands import main

sys.exit(main())
