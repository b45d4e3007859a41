"""The pure protocol core: routes, groups, outer-step math, step clock, membership, messages.

Nothing here does I/O, awaits, reads the wall clock or imports another part of the project.
"""
