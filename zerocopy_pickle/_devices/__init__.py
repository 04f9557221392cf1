"""Where storages go: ``map_location`` with ``torch.load``'s semantics (``device``), and bulk host-to-device
transfers, one allocation per device, chunked through pinned staging or registered host pages (``transfer``).

Layers inside (lowest first): ``device`` < ``transfer``.
"""
