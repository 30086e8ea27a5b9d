"""The benches. core is imported first, as every entry point does, so that its settings
for numpy's OpenBLAS (core/__init__.py) are in force here as in the app."""

import core  # noqa: F401
