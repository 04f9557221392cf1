"""A corpus of hostile pickle streams: every one must be refused before it runs.

Each payload, if it ran, would create a sentinel file; each test loads it wrapped in a valid snapshot, with the
default restricted load and with ``allow=`` naming every global the stream asks for (the blocklist must win),
and asserts that the load fails with this library's error and that the sentinel does not exist. The corpus
follows the public ones (picklescan's and fickling's test files, PyTorch's weights-only advisories): direct
calls at every protocol, INST/OBJ/STACK_GLOBAL/EXT variants, getattr chains, dotted names, gadgets in
harmless-looking modules, nested loaders, code objects, and resource bombs.
"""

from __future__ import annotations

import contextlib
import copyreg
import functools
import io
import marshal
import os
import pickle
import re
import struct
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import zerocopy_pickle as zp
from tests.internals import DYNAMIC, MAX_MARKS, MAX_STACK, check_stream, is_blocked, safe_globals
from tests.internals import format as fmt


def as_snapshot(stream: bytes) -> bytes:
    """A well-formed snapshot (valid header, no buffers) whose pickle stream is ``stream``."""
    layout = fmt.encode(len(stream), [])
    return layout.prefix + stream + bytes(layout.data_offset - layout.stream_offset - len(stream))


class Reduce:
    """Pickles as ``func(*args)``."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.func, self.args


def dumps(obj: Any, protocol: int = 4) -> bytes:
    return pickle.dumps(obj, protocol=protocol)


def text(source: str) -> bytes:
    """A protocol-0 stream written by hand (one opcode per line, as pickletools documents them)."""
    return source.encode("latin-1")


def touch_command(path: Path) -> str:
    return f"touch {path}"


def code_payload(path: Path) -> bytes:
    """types.FunctionType(marshal.loads(<code>), {})(): a code object, rebuilt and called."""
    code = marshal.dumps(compile(f"open({str(path)!r}, 'w').close()", "<payload>", "exec"))
    return (
        b"\x80\x04ctypes\nFunctionType\n"
        + b"cmarshal\nloads\nB" + struct.pack("<I", len(code)) + code + b"\x85R"  # marshal.loads(code)
        + b"}\x86R"  # FunctionType(code, {})
        + b")R."  # ...()
    )  # fmt: skip


def cloudpickle_payload(path: Path) -> bytes:
    cloudpickle = pytest.importorskip("cloudpickle")
    target = str(path)

    def run() -> None:  # a local function: cloudpickle sends it by value (_make_function)
        open(target, "w").close()

    return cloudpickle.dumps(Reduce(run))


def nested_torch_load_payload(path: Path) -> bytes:
    inner = path.with_suffix(".pt")
    torch.save(Reduce(os.system, touch_command(path)), inner)
    return dumps(Reduce(functools.partial(torch.load, weights_only=False), str(inner)))


def stack_global_from_memo(path: Path) -> bytes:
    cmd = touch_command(path).encode()
    return (
        b"\x80\x04"
        + b"\x8c\x02os\x94"  # 'os' -> memo 0
        + b"\x8c\x06system\x94"  # 'system' -> memo 1
        + b"0"  # POP (the 'system' string)
        + b"0"  # POP (the 'os' string)
        + b"h\x00h\x01\x93"  # BINGET 0, BINGET 1, STACK_GLOBAL
        + b"\x8c" + bytes([len(cmd)]) + cmd + b"\x85R."
    )  # fmt: skip


def ext_payload(path: Path) -> Iterator[bytes]:
    copyreg.add_extension("os", "system", 0x7FF0)
    try:
        cmd = touch_command(path).encode()
        yield b"\x80\x02\x83\xf0\x7f" + b"X" + struct.pack("<I", len(cmd)) + cmd + b"\x85R."
    finally:
        copyreg.remove_extension("os", "system", 0x7FF0)


ALIAS_MODULE = "zcp_hostile_alias"


def alias_payload(path: Path) -> bytes:
    """A harmless-looking module re-exporting os.system; the stream names the alias."""
    cmd = touch_command(path).encode()
    module = ALIAS_MODULE.encode()
    return b"c" + module + b"\nrun\n(S'" + cmd + b"'\ntR."


PAYLOADS: dict[str, Callable[[Path], bytes]] = {
    **{
        f"os.system-protocol-{p}": (lambda path, p=p: dumps(Reduce(os.system, touch_command(path)), p))
        for p in range(6)
    },
    "posix.system-GLOBAL": lambda path: text(f"cposix\nsystem\n(S'{touch_command(path)}'\ntR."),
    "subprocess.Popen": lambda path: dumps(Reduce(__import__("subprocess").Popen, ["touch", str(path)])),
    "subprocess.check_call": lambda path: dumps(Reduce(__import__("subprocess").check_call, ["touch", str(path)])),
    "builtins.eval": lambda path: dumps(Reduce(eval, f"__import__('os').system({touch_command(path)!r})")),
    "builtins.exec": lambda path: dumps(Reduce(exec, f"open({str(path)!r}, 'w').close()")),
    "builtins.open": lambda path: dumps(Reduce(open, str(path), "w")),
    "io.open": lambda path: text(f"cio\nopen\n(S'{path}'\nS'w'\ntR."),
    "_io.FileIO": lambda path: text(f"c_io\nFileIO\n(S'{path}'\nS'w'\ntR."),
    "getattr-chain": lambda path: text(
        f"cbuiltins\ngetattr\n(cbuiltins\n__import__\n(S'os'\ntRS'system'\ntR(S'{touch_command(path)}'\ntR."
    ),
    "INST": lambda path: text(f"(S'{touch_command(path)}'\nios\nsystem\n."),
    "OBJ": lambda path: text(f"(cos\nsystem\nS'{touch_command(path)}'\no."),
    "STACK_GLOBAL-from-memo": stack_global_from_memo,
    "dotted-pathlib-os.system": lambda path: text(f"cpathlib\nos.system\n(S'{touch_command(path)}'\ntR."),
    "dotted-method-Path.touch": lambda path: text(f"cpathlib\nPath.touch\n(cpathlib\nPath\n(S'{path}'\ntRtR."),
    "dotted-torch-serialization.load": lambda path: text(f"ctorch\nserialization.load\n(S'{path}'\ntR."),
    "pkgutil.resolve_name": lambda path: text(
        f"cpkgutil\nresolve_name\n(S'os:system'\ntR(S'{touch_command(path)}'\ntR."
    ),
    "cProfile.run": lambda path: dumps(Reduce(__import__("cProfile").run, f"open({str(path)!r}, 'w').close()")),
    "timeit.timeit": lambda path: text(f"ctimeit\ntimeit\n(S'open({str(path)!r}, \"w\").close()'\ntR."),
    "shutil.copyfile": lambda path: dumps(Reduce(__import__("shutil").copyfile, __file__, str(path))),
    "operator.methodcaller": lambda path: text(
        f"coperator\nmethodcaller\n(S'system'\nS'{touch_command(path)}'\ntR(cbuiltins\n__import__\n(S'os'\ntRtR."
    ),
    "nested-pickle.loads": lambda path: dumps(Reduce(pickle.loads, dumps(Reduce(os.system, touch_command(path))))),
    "nested-torch.load-weights_only=False": nested_torch_load_payload,
    "torch.jit.load": lambda path: text(f"ctorch.jit\nload\n(S'{path}'\ntR."),
    "dill.loads": lambda path: text(f"cdill\nloads\n(C{chr(3)}abc\ntR."),
    "marshal-code-FunctionType": code_payload,
    "cloudpickle-_make_function": cloudpickle_payload,
    "runpy.run_path": lambda path: text(f"crunpy\nrun_path\n(S'{path}.py'\ntR."),
    "ctypes.CDLL": lambda path: text("cctypes\nCDLL\n(S'libc.so.6'\ntR."),
    "webbrowser.open": lambda path: text(f"cwebbrowser\nopen\n(S'file://{path}'\ntR."),
    "asyncio.create_subprocess_shell": lambda path: text(
        f"casyncio\ncreate_subprocess_shell\n(S'{touch_command(path)}'\ntR."
    ),
    "numpy-runstring": lambda path: text(
        f"cnumpy.testing._private.utils\nrunstring\n(S'open({str(path)!r}, \"w\").close()'\n(dtR."
    ),
    "harmless-looking-alias": alias_payload,
    "valid-stream-then-payload": lambda path: dumps({"ok": 1}, 5) + dumps(Reduce(os.system, touch_command(path))),
}


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "PWNED"
    module = types.ModuleType(ALIAS_MODULE)
    module.run = os.system  # type: ignore[attr-defined]
    sys.modules[ALIAS_MODULE] = module
    yield path
    del sys.modules[ALIAS_MODULE]
    assert not path.exists(), "a payload ran"


def test_the_corpus_is_large_enough() -> None:
    assert len(PAYLOADS) + 1 >= 30  # + the EXT payload below


def stream_globals(stream: bytes) -> list[str]:
    try:
        found = zp.scan(as_snapshot(stream))
    except zp.SnapshotError:
        return []
    return [f"{m}:{q}" for m, q in found if (m, q) != DYNAMIC]


def assert_refused(stream: bytes, sentinel: Path) -> None:
    data = as_snapshot(stream)
    for allow in ([], stream_globals(stream)):
        with pytest.raises((zp.RestrictedLoadError, zp.SnapshotError)):
            zp.loads(data, allow=allow)
        assert not sentinel.exists()
    # The pickler-shaped API, directly on the raw stream (no snapshot, so no stream check): it may return
    # what precedes a payload, or fail, but never run it.
    with contextlib.suppress(zp.RestrictedLoadError, pickle.UnpicklingError, zp.SnapshotError, EOFError):
        zp.ZeroCopyUnpickler(io.BytesIO(stream)).load()
    assert not sentinel.exists()


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_payload_is_refused_and_never_runs(name: str, sentinel: Path) -> None:
    stream = PAYLOADS[name](sentinel)
    assert_refused(stream, sentinel)


def test_ext_opcode_payload(sentinel: Path) -> None:
    for stream in ext_payload(sentinel):
        assert_refused(stream, sentinel)


# Payloads that create their sentinel when plain pickle loads them (the others need files or services).
LIVE = [
    *(f"os.system-protocol-{p}" for p in range(6)), "posix.system-GLOBAL", "subprocess.Popen",
    "subprocess.check_call", "builtins.eval", "builtins.exec", "builtins.open", "io.open", "_io.FileIO",
    "getattr-chain", "INST", "OBJ", "STACK_GLOBAL-from-memo", "pkgutil.resolve_name", "cProfile.run",
    "timeit.timeit", "shutil.copyfile", "nested-pickle.loads", "nested-torch.load-weights_only=False",
    "marshal-code-FunctionType", "cloudpickle-_make_function", "asyncio.create_subprocess_shell",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", LIVE)
def test_the_payload_is_live(name: str, tmp_path: Path) -> None:
    """Control: unrestricted pickle does run it (so the refusals above prove something)."""
    victim = tmp_path / "proof"
    result = pickle.loads(PAYLOADS[name](victim))
    if name == "asyncio.create_subprocess_shell":
        import asyncio

        asyncio.run(_await(result))
    elif hasattr(result, "wait"):  # a Popen
        result.wait()
    elif hasattr(result, "close"):  # a file
        result.close()
    assert victim.exists()


async def _await(coroutine: Any) -> None:
    process = await coroutine
    await process.wait()


def test_blocklist_wins_over_allow_for_a_plain_name(sentinel: Path) -> None:
    stream = dumps(Reduce(os.system, touch_command(sentinel)))
    with pytest.raises(zp.RestrictedLoadError, match="blocklist") as info:
        zp.loads(as_snapshot(stream), allow=[os.system, "posix:system", "os:system"])
    assert info.value.blocked == (("posix", "system"),)
    assert "no allow= can permit" in str(info.value)


def test_no_safe_global_is_blocked() -> None:
    """Every safe global is outside the blocklist, but for the torch._C._nn builtins the safe set admits by name
    as values (torch._C is blocked as a whole): those must be exactly the listed ones, and never callable."""
    from tests.internals import NN_BUILTIN_VALUES, safe_table

    for pair, obj in safe_globals().items():
        if pair[0] == "torch._C._nn":
            assert pair[1] in NN_BUILTIN_VALUES and not safe_table()[pair].callable, pair
            continue
        assert not is_blocked(pair, obj), pair


# --- resource bombs: refused by the stream check before the unpickler allocates -----------------------------


def test_memo_bomb() -> None:
    stream = b"\x80\x05N" + b"r" + struct.pack("<I", 2**31) + b"."
    with pytest.raises(zp.SnapshotError, match="skips ahead of the memo"):
        zp.loads(as_snapshot(stream))


def test_memo_read_of_unwritten_index() -> None:
    with pytest.raises(zp.SnapshotError, match="never written"):
        zp.loads(as_snapshot(b"\x80\x05j" + struct.pack("<I", 5) + b"."))


def test_dup_bomb() -> None:
    stream = b"\x80\x05N" + b"2" * (MAX_STACK + 10) + b"."
    with pytest.raises(zp.SnapshotError, match="stack grows deeper"):
        zp.loads(as_snapshot(stream))


def test_mark_nesting_bomb() -> None:
    with pytest.raises(zp.SnapshotError, match="MARK nesting"):
        zp.loads(as_snapshot(b"\x80\x05" + b"(" * (MAX_MARKS + 1) + b"N."))


@pytest.mark.parametrize("opcode", [b"\x8e", b"\x8d", b"\x96"], ids=["BINBYTES8", "BINUNICODE8", "BYTEARRAY8"])
def test_absurd_lengths(opcode: bytes) -> None:
    stream = b"\x80\x05" + opcode + struct.pack("<Q", 2**62) + b"x."
    with pytest.raises(zp.SnapshotError, match="runs past the end"):
        zp.loads(as_snapshot(stream))


def test_frame_past_the_end() -> None:
    with pytest.raises(zp.SnapshotError, match="FRAME"):
        zp.loads(as_snapshot(b"\x80\x05\x95" + struct.pack("<Q", 2**40) + b"N."))


# An opcode that takes its operands from below its MARK: the bounds check counts the stack across frames and
# passes these, and the analysis finds the frame empty (as the C unpickler does) and names the opcode's offset.
_BELOW_THE_MARK = {
    "MEMOIZE": (b"N(\x94" + b"1.", 4, "IndexError (list index out of range)"),
    "DUP": (b"N(2" + b"1.", 4, "IndexError (list index out of range)"),
    "TUPLE1": (b"N(\x85" + b"1.", 4, "IndexError (list index out of range)"),
    "TUPLE2": (b"N(N\x86" + b"1.", 5, "IndexError (list index out of range)"),
    "REDUCE": (b"cbuiltins\nlist\n()R" + b"1.", 19, "IndexError (list index out of range)"),
    "SETITEM": (b"}(NNs" + b"1.", 6, "IndexError (list index out of range)"),
    "BUILD": (b"cbuiltins\nlist\n)R(Nb" + b"1.", 21, "IndexError (list index out of range)"),
    "STACK_GLOBAL": (b"\x8c\x01a(\x8c\x01b\x93" + b"1.", 9, "IndexError (pop from empty list)"),
    "NEWOBJ_EX": (b"cbuiltins\nlist\n)(}\x92" + b"1.", 20, "IndexError (pop from empty list)"),
    "READONLY_BUFFER": (b"\x97(\x98" + b"1.", 4, "IndexError (list index out of range)"),
}


@pytest.mark.parametrize("opcode", sorted(_BELOW_THE_MARK))
def test_an_opcode_reaching_below_its_mark_is_malformed(opcode: str) -> None:
    body, offset, cause = _BELOW_THE_MARK[opcode]
    stream = b"\x80\x05" + body
    check_stream(stream)  # the bounds check passes it: the analysis's handler for the opcode is what refuses
    message = f"the pickle stream is malformed at byte {offset}: {cause} while checking what it does"
    with pytest.raises(zp.SnapshotError, match=re.escape(message)):
        zp.loads(as_snapshot(stream))


def test_amplifying_constructors_are_not_in_the_safe_set() -> None:
    # bytearray(2**40) would zero-fill a terabyte; range feeds list() any length.
    for payload in (Reduce(bytearray, 2**40), Reduce(list, range(10**12)), Reduce(bytes, 2**40)):
        with pytest.raises(zp.RestrictedLoadError):
            zp.loads(as_snapshot(dumps(payload, 5)))


def test_more_buffers_requested_than_declared() -> None:
    with pytest.raises(zp.SnapshotError, match=r"consumes 1 out-of-band buffer\(s\), the header declares 0"):
        zp.loads(as_snapshot(b"\x80\x05\x97."))


def test_persistent_ids_are_refused() -> None:
    with pytest.raises(zp.SnapshotError, match="persistent IDs"):
        zp.loads(as_snapshot(b"\x80\x05\x8c\x01xQ."))


def test_out_of_bounds_sparse_indices_are_refused() -> None:
    class BadSparse:
        def __reduce__(self) -> tuple[Any, ...]:
            indices = torch.tensor([[0, 1_000_000]])  # index far outside size 3
            return torch._utils._rebuild_sparse_tensor, (torch.sparse_coo, (indices, torch.ones(2), (3,)))

    with pytest.raises(zp.SnapshotError, match="does not rebuild"):
        zp.loads(zp.dumps(BadSparse()))


def test_tensor_view_outside_its_storage_is_refused() -> None:
    class Overreach:
        def __reduce__(self) -> tuple[Any, ...]:
            storage = torch.ones(4).untyped_storage()
            return zp.rebuild.rebuild_tensor, (storage, torch.float32, 0, (1_000_000,), (1,), False)

    with pytest.raises(zp.SnapshotError, match="reaches element 999999, but the storage holds 4"):
        zp.loads(zp.dumps(Overreach()))
