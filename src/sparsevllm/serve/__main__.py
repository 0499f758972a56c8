import sys

from sparsevllm.serve.cli import main

sys.exit(main())
