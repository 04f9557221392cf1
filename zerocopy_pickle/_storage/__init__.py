"""Where a snapshot's bytes live and how they are read: the file layout and its one header decoder, the writers
(aligned and parallel writes, each byte copied once), the arena (sealed memfds, private mappings), atomic files
(a snapshot written to a path, and the one atomic writer of small files in a directory held open), checksums and
signatures, the sources a load opens (path, file object, bytes, fd), background reads into the page cache,
progress bars, snapshots at URLs, and a file's identity as ``os.stat`` sees it. Needs no torch, so the model
cache's server uses it too.

Layers inside (lowest first; each imports only those before it): ``fileid`` | ``format`` < ``decoding`` |
``writes`` < ``arena`` | ``atomic`` | ``progress`` | ``readahead`` < ``integrity`` | ``sources`` < ``remote``.
"""
