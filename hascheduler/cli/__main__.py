import sys

from hascheduler.cli.main import main

sys.exit(main())
