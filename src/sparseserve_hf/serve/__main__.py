"""`python -m sparseserve_hf.serve [MODEL_FOLDER] ...` = `sparseserve-hf serve [MODEL_FOLDER] ...`."""

import sys

from .cli import main

if __name__ == "__main__":
    main(["serve", *sys.argv[1:]])
