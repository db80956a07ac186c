"""python -m jdp.report WORKDIR [WORKDIR ...]: see jdp.report."""

import sys

from jdp.report import main

sys.exit(main())
