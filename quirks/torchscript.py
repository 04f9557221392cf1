"""TorchScript: ``ScriptModule`` (scripted or traced) and ``ScriptFunction`` through ``torch.jit.save``.

Plain pickle cannot take TorchScript objects: their state lives in C++ (``torch._C.ScriptModule``) and
``ScriptModule.__getstate__`` refuses. This quirk reduces each one to the archive ``torch.jit.save`` writes,
repacked so that every record is stored uncompressed (``ZIP_STORED``) at a 64-byte aligned offset, and puts the
archive bytes in a ``uint8`` tensor: the pickler sends that tensor's storage out of band, so the archive lies in
the snapshot's data region and a load hands ``torch.jit.load`` a view of the mapping, not a copy
(:func:`zerocopy_pickle.plugin.jit_load_from_buffer`; the native implementation imports straight from it).

What ``torch.jit.save`` preserves survives: code, methods, parameters, buffers and TorchScript attributes,
``training`` of every submodule, ``requires_grad``. What it does not, does not: Python-only attributes set on a
``ScriptModule``, the Python subclass (a traced module comes back as ``RecursiveScriptModule``, as from
``torch.jit.load``), ``_extra_files`` (not part of the object), and tensor identity with the rest of the
graph (the archive holds its own copy of every tensor the module owns).

Loading a TorchScript archive runs TorchScript code (``__setstate__`` methods) and torch's C++ unpickler on
the archive's bytes, and TorchScript can read and write files (``torch.from_file(..., shared=True)``) without
any Python. So the rebuild functions are **not** declared safe globals: only ``trusted=True`` loads (or an
explicit ``allow=[zp.allow_function(...)]`` of its rebuild functions) accept a snapshot holding TorchScript.
See ``docs/quirks.md``.
"""

from __future__ import annotations

import builtins
import io
import struct
import sys
import zipfile
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from zerocopy_pickle.plugin import DeviceError, DumpError, SnapshotError, jit_load_from_buffer, type_key

if TYPE_CHECKING:
    from zerocopy_pickle.plugin import Registrar

__all__ = [
    "MODULE_TARGETS",
    "RECORD_ALIGNMENT",
    "is_stored_and_aligned",
    "rebuild_script_function",
    "rebuild_script_module",
    "reduce_script_function",
    "reduce_script_module",
    "register",
    "script_archive",
    "stored_archive",
]

MODULE_TARGETS = (
    "torch.jit._script:ScriptModule",  # also user subclasses (legacy @script_method modules)
    "torch.jit._script:RecursiveScriptModule",  # torch.jit.script and torch.jit.load results
    "torch.jit._trace:TracedModule",  # submodules of a traced module
    "torch.jit._trace:TopLevelTracedModule",  # torch.jit.trace(module)
)
"""The Python classes of TorchScript modules in torch 2.x, as ``module:QualName`` (the registry's keys)."""

RECORD_ALIGNMENT = 64
"""torch's zip writer (``caffe2/serialize/inline_container.cc``, ``kFieldAlignment``) starts every record's data
at a multiple of 64 bytes, padding the local header's extra field; a reader that maps records in place (torch's
``mmap`` loads, a native importer) relies on it. The repacked archive keeps it."""

_PADDING_ID = b"FB"  # the extra-field id torch's writer uses for its padding
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # a zip local file header, 30 bytes
_LOCAL_SIGNATURE = b"PK\x03\x04"
# torch's private TorchScript bindings, whose stubs disagree with their real signatures (import_ir_module_from_buffer
# takes bytes and five arguments; ScriptModule(name, unit, mangle) has _define): typed as what they are, Any.
_C: Any = torch._C
_ZIP64_FROM = 1 << 30  # entries this large get ZIP64 local headers (decided here, so the padding is exact)


# -- the archive -------------------------------------------------------------------------------------------------


def _data_offset(data: memoryview, info: zipfile.ZipInfo) -> int:
    """Where the bytes of ``info``'s record start (after its local header, whose extra field may differ from the
    central directory's)."""
    header = data[info.header_offset : info.header_offset + _LOCAL_HEADER.size]
    fields = _LOCAL_HEADER.unpack(header)
    if fields[0] != _LOCAL_SIGNATURE:
        raise zipfile.BadZipFile(f"bad local header for {info.filename!r}")
    name_len, extra_len = fields[9], fields[10]
    return int(info.header_offset) + _LOCAL_HEADER.size + int(name_len) + int(extra_len)


def is_stored_and_aligned(archive: bytes | bytearray | memoryview) -> bool:
    """Whether every record of a zip archive is stored uncompressed at a :data:`RECORD_ALIGNMENT` offset."""
    data = memoryview(archive).cast("B")
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return all(
            info.compress_type == zipfile.ZIP_STORED and _data_offset(data, info) % RECORD_ALIGNMENT == 0
            for info in zf.infolist()
        )


def stored_archive(archive: bytes | bytearray | memoryview) -> memoryview:
    """``archive`` with every record stored uncompressed at a 64-byte aligned offset.

    torch 2.x deflates the ``code/`` and ``debug_pkl`` records of a TorchScript archive; a load would inflate
    them again every time. The repacked archive keeps the records, their order (torch's reader takes the archive
    name from the first one), names, CRCs and timestamps, and pads each local header with an ``FB`` extra field
    as torch's own writer does. An archive that already qualifies is returned as it is.
    """
    data = memoryview(archive).cast("B")
    if is_stored_and_aligned(data):
        return data
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            payload = src.read(info)  # inflates, and checks the CRC
            entry = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            entry.compress_type = zipfile.ZIP_STORED
            entry.create_system = info.create_system
            entry.external_attr = info.external_attr
            entry.file_size = entry.compress_size = len(payload)
            entry.CRC = info.CRC
            # Decide ZIP64 here rather than leave it to zipfile, whose rule is internal: a ZIP64 local header is
            # 20 bytes longer, and the padding must account for it exactly.
            zip64 = len(payload) >= _ZIP64_FROM
            offset = out.tell()
            entry.extra = b""
            unpadded = len(entry.FileHeader(zip64)) + 4  # + the padding field's own id and length
            padding = -(offset + unpadded) % RECORD_ALIGNMENT
            entry.extra = _PADDING_ID + struct.pack("<H", padding) + b"Z" * padding
            with dst.open(entry, "w", force_zip64=zip64) as f:
                f.write(payload)
            # The padding belongs in the local header only (as torch writes it), not in the central directory.
            entry.extra = b""
    repacked = out.getbuffer()
    if not is_stored_and_aligned(repacked):  # a zipfile whose local headers differ from what FileHeader says
        raise DumpError(f"repacking a TorchScript archive left records compressed or unaligned (Python {sys.version})")
    return repacked


def script_archive(obj: Any) -> memoryview:
    """``torch.jit.save(obj)``'s archive, repacked by :func:`stored_archive`."""
    buffer = io.BytesIO()
    torch.jit.save(obj, buffer)
    return stored_archive(buffer.getbuffer())


def _archive_tensor(archive: memoryview) -> torch.Tensor:
    # A uint8 tensor over the archive (no copy): its storage is what the pickler sends out of band, so the bytes
    # are written once, straight into the snapshot's data region.
    return torch.frombuffer(archive, dtype=torch.uint8) if archive.nbytes else torch.empty(0, dtype=torch.uint8)


def _host_buffer(archive: torch.Tensor) -> Any:
    """A bytes-like view of the archive tensor, without a copy when it is a CPU tensor (the usual case)."""
    if archive.device.type != "cpu":
        # A map_location that sends CPU storages elsewhere moved the archive too: bring it back (one copy).
        archive = archive.cpu()
    return archive.contiguous().numpy()  # the array keeps the tensor, and so the mapping, alive


# -- devices -----------------------------------------------------------------------------------------------------

# Note [TorchScript devices]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# The tensors inside the archive are not storages of the snapshot, so the load's map_location never sees them.
# For every device the module's parameters and buffers are on, the reduced arguments carry an empty storage
# *on that device*. The snapshot records its location like any storage's: a load checks the target exists
# before it builds anything (DeviceError naming map_location, as for any storage), and applies map_location to
# it (string, dict or callable). Where each marker lands is where the module goes: torch.jit.load takes a single
# device (or None for the saved ones), so a module whose devices all stay put loads with None, one whose devices
# all go to one device loads there, and a mix is refused.


def _module_devices(module: torch.nn.Module) -> list[torch.device]:
    devices: dict[str, torch.device] = {}
    for tensor in (*module.parameters(), *module.buffers()):
        devices.setdefault(str(tensor.device), tensor.device)
    return list(devices.values())


def _device_markers(module: torch.nn.Module) -> tuple[tuple[str, torch.UntypedStorage], ...]:
    markers = []
    for dev in _module_devices(module):
        if dev.type == "meta":
            continue  # torch.jit.save cannot write meta tensors anyway
        markers.append((str(dev), torch.UntypedStorage(0, device=dev)))
    return tuple(markers)


def _map_location(markers: Iterable[tuple[str, Any]]) -> torch.device | None:
    """The single ``map_location`` for ``torch.jit.load`` that puts each saved device where its marker landed."""
    targets: dict[str, str] = {}
    for saved, marker in markers:
        if not isinstance(saved, str) or not isinstance(marker, (torch.UntypedStorage, torch.Tensor)):
            raise SnapshotError(f"malformed TorchScript device marker {saved!r:.40}: {type(marker).__name__}")
        targets[saved] = str(marker.device)
    if all(torch.device(saved) == torch.device(target) for saved, target in targets.items()):
        return None  # every tensor returns to the device it was saved from, as torch.jit.load does by default
    distinct = set(targets.values())
    if len(distinct) == 1:
        return torch.device(distinct.pop())
    raise DeviceError(
        f"this TorchScript module was saved on {sorted(targets)} and map_location sends those to "
        f"{[targets[k] for k in sorted(targets)]}; torch.jit.load places a module on one device only: map "
        f"every saved device to the same one (map_location='cpu', say)"
    )


# -- modules -----------------------------------------------------------------------------------------------------


def reduce_script_module(module: torch.jit.ScriptModule) -> tuple[Any, ...]:
    """Reduce a TorchScript module (scripted, traced or loaded) to its ``torch.jit.save`` archive.

    Raises:
        DumpError: ``torch.jit.save`` refused the module (the message says why).
    """
    try:
        archive = script_archive(module)
    except (RuntimeError, torch.jit.Error) as e:
        raise DumpError(f"torch.jit.save cannot save this {type(module).__name__}: {e}") from e
    return rebuild_script_module, (_archive_tensor(archive), _device_markers(module))


def rebuild_script_module(archive: torch.Tensor, devices: Sequence[tuple[str, Any]] = ()) -> Any:
    """Load the ``torch.jit.save`` archive held by the ``uint8`` tensor ``archive``.

    ``devices`` pairs each device the module was saved from with an empty storage placed by the load's
    ``map_location`` (Note [TorchScript devices]).
    """
    if not isinstance(archive, torch.Tensor) or archive.dtype != torch.uint8 or archive.dim() != 1:
        raise SnapshotError("a TorchScript archive must be a 1-D uint8 tensor")
    map_location = _map_location(devices)
    buffer = _host_buffer(archive)
    return jit_load_from_buffer(buffer, map_location)


# -- functions ---------------------------------------------------------------------------------------------------

# Note [ScriptFunction archives]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch.jit.save takes modules only, and ScriptFunction.save() stores the function's graph as the `forward`
# of a placeholder module: loading it gives back a method, and drops the defaults of the arguments. Instead the
# function is saved as a *callee*: a module whose forward calls it. The archive then holds the function itself,
# under its qualified name, with its schema (defaults included), in the compilation unit the load creates; the
# rebuild finds it there by name. The ScriptFunction it returns holds that compilation unit alive.


def _module_of(qualified_name: str) -> Any:
    """The imported module a TorchScript qualified name (``__torch__.pkg.mod.Name``) lives in, or None."""
    path = qualified_name.removeprefix("__torch__.").split(".")
    for split in range(len(path) - 1, 0, -1):
        module = sys.modules.get(".".join(path[:split]))
        if module is not None:
            return module
    return None


def _resolver(fn: Any) -> Callable[[str], Any]:
    """The resolution callback for the holder's source: what a name means where ``fn`` was defined.

    The source names ``fn`` and the types of its arguments, written as TorchScript prints them:
    ``__torch__.pkg.mod.Class`` for a TorchScript class or NamedTuple. A NamedTuple whose fields are string
    annotations (``from __future__ import annotations``) also asks for those (``torch.Tensor``, ``int``), which
    resolve in the globals of ``fn``'s module, as when it was compiled. Only modules already imported are
    consulted: resolving never imports anything.
    """
    home = _module_of(fn.qualified_name)
    namespace: dict[str, Any] = dict(vars(builtins), **(vars(home) if home is not None else {}))

    def resolve(name: str) -> Any:
        if name == "__zcp_function":
            return fn
        if name.startswith("__torch__."):
            module = _module_of(name)
            if module is None:
                return None
            obj = module
            for part in name.removeprefix(f"__torch__.{module.__name__}.").split("."):
                obj = getattr(obj, part, None)
            return obj
        head, *rest = name.split(".")
        obj = namespace.get(head)
        for part in rest:
            obj = getattr(obj, part, None)
        return obj

    return resolve


def _function_holder(fn: Any) -> torch.jit.ScriptModule:
    """A ScriptModule whose ``forward`` takes ``fn``'s arguments and calls ``fn`` (Note [ScriptFunction archives])."""
    arguments = list(fn.schema.arguments)
    params = ", ".join(f"a{i}: {arg.type.annotation_str}" for i, arg in enumerate(arguments))
    call = ", ".join(f"{arg.name}=a{i}" if arg.kwarg_only else f"a{i}" for i, arg in enumerate(arguments))
    source = f"def forward(self{', ' if params else ''}{params}):\n    return __zcp_function({call})\n"

    # A fresh C++ module in a compilation unit of its own: a Python ScriptModule class would share one TorchScript
    # type (and so one `forward`) between all holders, and leave a type behind in torch's global unit per dump.
    module = _C.ScriptModule("__torch__.zerocopy_pickle.FunctionHolder", torch._C.CompilationUnit(), True)
    module._register_attribute("training", _C.BoolType.get(), False)
    module._define(_C.ConcreteModuleType.from_jit_type(module._type()), source, _resolver(fn))
    holder: torch.jit.ScriptModule = torch.jit._recursive.wrap_cpp_module(module)
    return holder


def reduce_script_function(fn: Any) -> tuple[Any, ...]:
    """Reduce a ``torch.jit.ScriptFunction`` (``torch.jit.script`` or ``torch.jit.trace`` of a function).

    Raises:
        DumpError: the function's signature cannot be written as a TorchScript call (the message says why).
    """
    try:
        holder = _function_holder(fn)
        archive = script_archive(holder)
    except (RuntimeError, torch.jit.Error) as e:
        raise DumpError(
            f"cannot save the ScriptFunction {fn.qualified_name} ({fn.schema}) through torch.jit.save: {e}; hold it "
            f"in a scripted module whose method calls it instead"
        ) from e
    return rebuild_script_function, (_archive_tensor(archive), fn.qualified_name)


def rebuild_script_function(archive: torch.Tensor, qualified_name: str) -> Any:
    """Load the ScriptFunction named ``qualified_name`` from the archive of its holder module.

    Raises:
        SnapshotError: the archive holds no function of that name.
    """
    if not isinstance(archive, torch.Tensor) or archive.dtype != torch.uint8 or archive.dim() != 1:
        raise SnapshotError("a TorchScript archive must be a 1-D uint8 tensor")
    if not isinstance(qualified_name, str):
        raise SnapshotError(f"a ScriptFunction's name must be a string, not {type(qualified_name).__name__}")
    unit = _C.CompilationUnit()
    # The function must come out of a compilation unit this code holds, which torch.jit.load (and so
    # jit_load_from_buffer) does not expose: import into one directly. Function archives hold code and
    # constants only, so the copy into bytes is small.
    _C.import_ir_module_from_buffer(unit, bytes(_host_buffer(archive)), None, {}, False)
    fn = unit.find_function(qualified_name)
    if fn is None:
        raise SnapshotError(f"the TorchScript archive holds no function {qualified_name!r}")
    return fn


# -- registration ------------------------------------------------------------------------------------------------

FUNCTION_TARGET = type_key(torch._C.ScriptFunction)
"""The registry key of ``torch.jit.ScriptFunction``, a pybind11 class whose ``__qualname__`` is its dotted name
(``"torch.jit:torch.jit.ScriptFunction"`` in torch 2.x): computed from the class so that it matches whatever this
torch calls it. torch is always imported when zerocopy_pickle is, so this imports nothing new."""


def register(registry: Registrar) -> None:
    """Register the TorchScript reducers (entry point ``torchscript``). Declares no safe globals: see the module
    docstring."""
    for target in MODULE_TARGETS:
        registry.register_reducer(target, reduce_script_module)
    registry.register_reducer(FUNCTION_TARGET, reduce_script_function)
