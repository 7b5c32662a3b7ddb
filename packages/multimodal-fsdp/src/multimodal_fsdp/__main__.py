"""``python -m multimodal_fsdp``: the command line of
[`multimodal_fsdp.cli.main`][multimodal_fsdp.cli.main]."""

import sys

from multimodal_fsdp.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
