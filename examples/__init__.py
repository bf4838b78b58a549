"""eqpar's examples, importable from the root of a checkout: `from examples import lm` gives
the language model of `train_lm.py` (`docs/tutorials/together.md` builds it this way).

The scripts themselves run as programs (`python examples/train_lm.py`) and import their
neighbours by their own names (`import lm`), so this file only makes the folder a package.
"""
