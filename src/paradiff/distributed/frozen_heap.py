"""Imported last by the fork server local ranks start from (spawn.py: local_context), for its side effect:
everything the preload made is moved out of the garbage collector's reach (gc.freeze, after one collection), as
Python's documentation advises before forking. Every rank and command forked from the server then inherits a heap
its collections skip (measured on 2 cores under load, a forked child's first gc.collect(): 2.5-4 s and 38,000 page
faults without, 0.003 s and 1,750 with):
without it, each child's first full collection walked the millions of torch / diffusers / transformers objects
(0.3-0.4 s) and, by touching their headers, copied their memory pages from the server (copy-on-write)."""

import gc

gc.collect()
gc.freeze()
