"""Where storages go: ``map_location`` with ``torch.load``'s semantics (``device``), and bulk host-to-device
transfers, one allocation per device, chunked through pinned staging or registered host pages (``transfer``):
laid out as plain data (``plan``), run against a device backend (``backend``), read from the file itself when
it is not in the page cache (``coldread``).

Layers inside (lowest first; each imports only those before it): ``device`` < ``backend`` | ``plan`` <
``coldread`` < ``transfer``.
"""
