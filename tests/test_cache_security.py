"""The model cache against a hostile neighbour: bounded messages, a persistence directory someone else
prepared or changed, and a server or loader started in a directory holding someone's modules."""

from __future__ import annotations

import os
import socket
import struct
import threading

import pytest

from zerocopy_pickle import arena
from zerocopy_pickle.cache import protocol

# -- the wire ---------------------------------------------------------------------------------------------------


def test_a_huge_declared_length_is_refused_before_allocating() -> None:
    for prefix in (struct.pack("<II", 2, 0xFFFF_FFFF), struct.pack("<II", protocol.REQUEST.header + 1, 0)):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with ours, theirs:
            theirs.sendall(prefix)  # and nothing more: the receiver must not wait for (or reserve) the rest
            with pytest.raises(protocol.ProtocolError, match="refused"):
                protocol.receive(ours, protocol.REQUEST)


def test_a_message_is_read_whole_in_pieces_and_a_short_one_is_an_error() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    payload = os.urandom(3 << 20)  # several read pieces, more than a socket buffer
    with ours, theirs:
        sender = threading.Thread(target=protocol.send, args=(theirs, {"op": "x"}, payload))
        sender.start()
        header, data, fds = protocol.receive(ours, protocol.REQUEST)
        sender.join()
        assert header == {"op": "x"} and data == payload and fds == []
        theirs.sendall(struct.pack("<II", 2, 10) + b"{}abc")
        theirs.shutdown(socket.SHUT_WR)
        with pytest.raises(protocol.ProtocolError, match="hung up 7 bytes before the end"):
            protocol.receive(ours, protocol.REQUEST)


def test_file_descriptors_beyond_a_kinds_limit_are_refused_and_closed() -> None:
    memfd = arena.create_memfd("test")
    before = len(os.listdir("/proc/self/fd"))
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        protocol.send(theirs, {"op": "ping"}, fds=[memfd, memfd])
        with pytest.raises(protocol.ProtocolError, match="file descriptors"):
            protocol.receive(ours, protocol.REQUEST)  # clients send none
    assert len(os.listdir("/proc/self/fd")) == before  # what arrived was closed
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        protocol.send(theirs, {"op": "ping"}, fds=[memfd, memfd])
        _, _, fds = protocol.receive(ours, protocol.ENTRY)
        assert len(fds) == 2
        for fd in fds:
            os.close(fd)
    os.close(memfd)


def test_buffer_tables_are_checked() -> None:
    assert protocol.check_buffer_table([[1, 0, 8, "cpu", None]]) == [[1, 0, 8, "cpu", None]]
    for bad in ({}, [[1, -1, 8, "cpu", None]], [[1, 0, "8", "cpu", None]], [[1, 0, 8]], [None]):
        with pytest.raises(protocol.ProtocolError):
            protocol.check_buffer_table(bad)
