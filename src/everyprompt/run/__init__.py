"""The run directory, owned here: `layout` names every file and folder in it and finds them, `files` writes
them atomically, `machine` records the machine a run ran on. A leaf of the layers: every layer may read it,
and it imports nothing above it (where a run starts, which verifies checkpoints, is pipeline/resume.py).
"""
