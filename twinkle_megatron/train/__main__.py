"""``python -m twinkle_megatron.train``: the training job (:mod:`twinkle_megatron.train.job`)."""
import sys

from .job import main

if __name__ == "__main__":
    sys.exit(main())
