"""python -m nanotron_ext.bench.wan: the WAN meter (nanotron_ext.bench.wan.cli)."""
import sys

from nanotron_ext.bench.wan.cli import main

sys.exit(main())
