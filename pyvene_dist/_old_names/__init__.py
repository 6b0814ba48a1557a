"""Old module names of the package above, each forwarding to the module it is now (``pyvene_dist._moved_modules``).

The package lists this folder last on its ``__path__``; imported as a package of its own, it is empty."""
