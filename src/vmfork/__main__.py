import sys

from vmfork.cli import main

sys.exit(main())
