"""``python -m wiola ...`` is the ``wiola`` command; it also runs under
``torchrun --nproc_per_node N -m wiola train ...``."""

import sys

from wiola.cli import main

if __name__ == "__main__":
    sys.exit(main())
