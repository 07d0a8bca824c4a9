"""Capturing Q/K/V: the HDF5 capture file (``store``: the only module that knows the layout)
and running a model to fill it (``run``)."""
