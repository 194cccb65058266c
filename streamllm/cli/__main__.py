"""`python -m streamllm.cli ...`: the same as the `streamllm` command."""

import sys

from streamllm.cli import main

sys.exit(main())
