"""Imported last by the fork server of the multi-process tests (``spawning.PRELOAD``), after torch, transformers and
plait's trainers: every object those imports made is moved to the garbage collector's permanent generation
(``gc.freeze``), so a forked worker's collections never traverse them. A worker otherwise ran a full collection of
the ~400k imported objects (about 0.3 CPU-s) and wrote to their pages (copies of the server's memory); its own
objects are collected as before."""

import gc

gc.collect()
gc.freeze()
