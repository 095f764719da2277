import pathlib
import sys

# Tests import the repository's packages from the checkout, installed or not.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
