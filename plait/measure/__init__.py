"""Measurement on this machine: per-unit time and energy profiles of a model, the stage-to-stage link and the
device memory, the host's runtime costs, and the store of measured profiles keyed by what they measured.

Below the command verbs and above the training loop: it builds models, data and rank stages to time them
(``plait.train``, ``plait.parallel``) and writes what it measured as the planner's value types
(``plait.planner``); nothing below it imports it.
"""
