"""The core: step records, signal keys, depth groups, the engine and its detectors.

Pure Python: nothing here imports torch or Lightning, so the live monitor and the log replay run
the very same code.
"""
