import sys

sys.exit("figures are made by the notebooks: run `make figures` (python -m megamoe.notebooks figures)")
