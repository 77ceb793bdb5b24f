import sys

from blockshard.cli import main

sys.exit(main())
