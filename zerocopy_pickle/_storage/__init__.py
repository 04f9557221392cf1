"""Where a snapshot's bytes live and how they are read: the arena (aligned writes, atomic files, sealed memfds,
private mappings), the one atomic writer of small files in a directory held open, the file layout and its one
header reader, checksums and signatures, the sources a load opens (path, file object, bytes, fd), background
reads into the page cache, progress bars, and snapshots at URLs. Needs no torch, so the model cache's server
uses it too.

Layers inside (lowest first; each imports only those before it): ``format`` < ``arena`` | ``atomic`` |
``progress`` | ``readahead`` < ``integrity`` | ``sources`` < ``remote``.
"""
