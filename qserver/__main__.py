import sys

from qserver.cli import main

sys.exit(main())
