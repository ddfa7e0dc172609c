"""The recipes' packages are bert-impl's `recipes` extra (pyproject.toml). Every recipe imports this module before
anything else, so that one started without the extra stops with what to install, where its imports would end in a
bare ModuleNotFoundError (or transformers' ImportError about Trainer and accelerate)."""

import importlib.util
import os
import sys

# import name -> the package the `recipes` extra installs
RECIPES_EXTRA = {"datasets": "datasets", "accelerate": "accelerate", "sklearn": "scikit-learn", "scipy": "scipy",
                 "seqeval": "seqeval", "tqdm": "tqdm"}

missing = [package for module, package in RECIPES_EXTRA.items() if importlib.util.find_spec(module) is None]
if missing:
    sys.exit(f"{os.path.basename(sys.argv[0])} needs {', '.join(missing)}, of bert-impl's `recipes` extra: run "
             f"pip install -e \".[recipes]\" in the root of the bert-impl clone (or pip install {' '.join(missing)})")
