"""blockgrad's benchmark: `make bench` (python -m bench) prints one table of ratios.

Not part of the test suite. Every row is one function returning Results, so a
row can be added without touching the others (see ROWS in bench/__main__.py).
"""
