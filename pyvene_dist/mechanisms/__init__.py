"""Plain mechanisms shared by fixes: no ``Fix`` record, never an import of a fix module (``pyvene_dist.fixes.<name>``).

Each module here is code that more than one fix runs (binding a call's arguments, the tensors a model owns, the
dtype it computes in, ...); the fixes name what they wrap and why, these modules only how. They may import
``pyvene_dist._registry``, torch and pyvene.
"""
