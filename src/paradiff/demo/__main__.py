"""`python -m paradiff.demo`: the shipped demo transformer with tp=2 on 2 local CPU processes (see `tp_check`).

The work lives in a named module: spawned processes cannot find functions of a package's `__main__`."""

from paradiff.demo.tp_check import main

main()
