"""The run directory, owned here: `layout` names every file and folder in it and finds them; `resume`
decides whether a run starts fresh, resumes a cut-short phase, or warm-starts from a finished one.

Nothing is imported here: `layout` is a leaf that every layer may read, while `resume` sits above the
trainer (it verifies checkpoints), so importing one must not load the other.
"""
