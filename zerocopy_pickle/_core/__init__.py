"""The one mechanism: the pickler and the unpickler's mechanism sharing one set of reductions (``pickler``), the
failing object's path after a failed dump (``locate``), what every load and dump runs inside (``guards``: the
collector paused, sparse tensors checked), a dump before it is written and its diagnosis (``dumping``), the one
load core every consumer calls, which decides every load's policy, with the public ``ZeroCopyUnpickler`` over it
(``loadcore``), and the public entry points ``zerocopy_pickle`` re-exports (``snapshot``).

Layers inside (lowest first): ``guards`` < ``locate`` | ``pickler`` < ``dumping`` | ``loadcore`` < ``snapshot``.
"""
