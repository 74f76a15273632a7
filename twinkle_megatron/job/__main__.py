"""``python -m twinkle_megatron.job``: the training job (:mod:`twinkle_megatron.job.job`)."""
import sys

from .job import main

if __name__ == "__main__":
    sys.exit(main())
