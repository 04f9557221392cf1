"""Adapters for the streaming model loaders that ``benchmarks/coldstart.py`` times against zerocopy_pickle.

Each peer is a :class:`Peer`: ``prepare`` writes the peer's own file from a ``.safetensors`` file of a flat state
dict (or hands that file back, for the peers that read safetensors), and ``load`` reads every tensor of it into CPU
memory the way the peer's documentation recommends for its fastest CPU load, returning ``name -> tensor`` with the
file's bytes in memory (no lazy handles, no mappings). Every peer's package is imported only inside its methods, so
this module imports with stdlib, torch and safetensors alone; the peers come with the ``bench`` extra
(``pip install -c constraints.txt -e '.[bench]'``).

=====================  ==========================================================================================
peer                   load (CPU)
=====================  ==========================================================================================
runai-model-streamer   ``SafetensorsStreamer().stream_file(path)`` (device ``"cpu"``, owned tensors), then
                       ``get_tensors()``: ``RUNAI_STREAMER_CONCURRENCY`` reader threads (16 unless set), 2 MiB
                       chunks, no memory limit.
fastsafetensors        ``SafeTensorsFileLoader(SingleGroup(), device="cpu", nogds=True)`` (its documented CPU
                       path: the ``nogds`` bounce-buffer ``pread`` copier, ``max_threads=16``, 16 MiB buffers),
                       ``add_filenames``, ``copy_files_to_device()``, ``get_tensor`` of every key.
flashpack              ``read_flashpack_file(path, device="cpu")`` with ``FLASHPACK_CPU_PARALLEL_READ=1`` (its eager
                       parallel ``preadv`` reader; without it the CPU path returns lazy mmap views):
                       ``FLASHPACK_READ_THREADS`` threads (16, capped at the CPUs the process may run on).
tensorizer             ``TensorDeserializer(path, device="cpu", lazy_load=False)``: every tensor read up front by
                       its dynamic reader count (8 threads for a local file).
instanttensor          ``safe_open(path, framework="pt", device="cpu")``: it accepts CUDA devices only, so on a
                       CPU-only machine ``unavailable()`` says so.
=====================  ==========================================================================================

``unavailable()`` imports the peer and round-trips a tiny state dict through ``prepare`` and ``load`` in a
temporary folder: ``None`` when the bytes come back equal, else one line saying why not (the package is not
installed, its import fails, or its load fails on this machine, with the exception it raised).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import safetensors.torch
import torch

INSTALL_HINT = "pip install -c constraints.txt -e '.[bench]'"


@dataclasses.dataclass(frozen=True)
class Peer:
    """One peer loader: its name, its pip distribution, and how to prepare and load a state dict with it."""

    name: str  # e.g. "runai-model-streamer"
    package: str  # the pip distribution name

    module: ClassVar[str] = ""  # the import name of the peer's package
    suffix: ClassVar[str] = ""  # the file name suffix prepare() writes ("" for a peer that reads safetensors)

    def unavailable(self) -> str | None:
        """``None`` if the peer imports and round-trips a small state dict on this machine, else why not (one
        line)."""
        return _unavailable(self)

    def version(self) -> str | None:
        """The installed version of the peer's distribution, ``None`` if it is not installed."""
        try:
            return importlib.metadata.version(self.package)
        except importlib.metadata.PackageNotFoundError:
            return None

    def prepare(self, safetensors_path: str, workdir: str) -> str:
        """Write the peer's own file from ``safetensors_path`` (a flat state dict) into ``workdir`` and return its
        path, or return ``safetensors_path`` itself for a peer that reads safetensors."""
        if not self.suffix:
            return safetensors_path
        destination = str(Path(workdir) / f"{Path(safetensors_path).stem}.{self.name}{self.suffix}")
        self._write(safetensors.torch.load_file(safetensors_path), destination)
        return destination

    def load(self, path: str) -> dict[str, torch.Tensor]:
        """Every tensor of ``path`` (what ``prepare`` returned) read into CPU memory by the peer."""
        raise NotImplementedError

    def _write(self, state_dict: dict[str, torch.Tensor], destination: str) -> None:
        raise NotImplementedError


class RunaiModelStreamer(Peer):
    module = "runai_model_streamer"

    def load(self, path: str) -> dict[str, torch.Tensor]:
        from runai_model_streamer import SafetensorsStreamer

        tensors: dict[str, torch.Tensor] = {}
        # device="cpu" and owned=True are the defaults: each yielded tensor stays valid after the streamer closes.
        with SafetensorsStreamer() as streamer:
            streamer.stream_file(path, device="cpu")
            for name, tensor in streamer.get_tensors():
                tensors[name] = tensor
        return tensors


class FastSafetensors(Peer):
    module = "fastsafetensors"

    def load(self, path: str) -> dict[str, torch.Tensor]:
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        loader = SafeTensorsFileLoader(SingleGroup(), device="cpu", nogds=True)
        try:
            loader.add_filenames({0: [path]})
            buffers = loader.copy_files_to_device()
            try:
                # get_tensor's tensors share ownership of the buffer: they outlive its close().
                return {name: buffers.get_tensor(name) for name in loader.get_keys()}
            finally:
                buffers.close()
        finally:
            loader.close()


class Flashpack(Peer):
    module = "flashpack"
    suffix = ".flashpack"

    def _write(self, state_dict: dict[str, torch.Tensor], destination: str) -> None:
        from flashpack import pack_to_file

        pack_to_file(state_dict, destination, target_dtype=None)

    def load(self, path: str) -> dict[str, torch.Tensor]:
        from flashpack.deserialization import iterate_from_flash_tensor, read_flashpack_file

        with _environ(FLASHPACK_CPU_PARALLEL_READ="1"):
            storage, meta = read_flashpack_file(path, device="cpu")
        shapes = {record["name"]: tuple(record["shape"]) for record in meta["index"]}
        # The iteration gives a 0-d tensor the shape (1,): every view takes the shape its index records.
        return {name: view.view(shapes[name]) for name, view in iterate_from_flash_tensor(storage, meta)}


class Tensorizer(Peer):
    module = "tensorizer"
    suffix = ".tensors"

    def _write(self, state_dict: dict[str, torch.Tensor], destination: str) -> None:
        from tensorizer import TensorSerializer

        serializer = TensorSerializer(destination)
        try:
            serializer.write_state_dict(state_dict)
        finally:
            serializer.close()

    def load(self, path: str) -> dict[str, torch.Tensor]:
        from tensorizer import TensorDeserializer

        # num_readers=None (the default) picks its reader count: 8 threads for a local file (at most one per tensor).
        # It gives floating-point tensors as Parameters that require grad: detach() makes plain tensors of them,
        # on the same memory.
        with TensorDeserializer(path, device="cpu", lazy_load=False) as deserializer:
            return {str(name): tensor.detach() for name, tensor in deserializer.items()}


class InstantTensor(Peer):
    module = "instanttensor"

    def load(self, path: str) -> dict[str, torch.Tensor]:
        from instanttensor import safe_open

        with safe_open(path, framework="pt", device="cpu") as opened:
            return dict(opened.tensors())


PEERS: tuple[Peer, ...] = (
    RunaiModelStreamer("runai-model-streamer", "runai-model-streamer"),
    FastSafetensors("fastsafetensors", "fastsafetensors"),
    Flashpack("flashpack", "flashpack"),
    Tensorizer("tensorizer", "tensorizer"),
    InstantTensor("instanttensor", "instanttensor"),
)


def smoke_state_dict() -> dict[str, torch.Tensor]:
    """A small flat state dict of odd sizes in float32, float16 and bfloat16: what ``unavailable()`` round-trips."""
    generator = torch.Generator().manual_seed(0)
    return {
        "layer.weight": torch.randn(37, 129, generator=generator),
        "layer.bias": torch.randn(37, generator=generator).to(torch.float16),
        "norm.weight": torch.randn(3, 5, 7, generator=generator).to(torch.bfloat16),
    }


def same_tensors(expected: dict[str, torch.Tensor], loaded: dict[str, Any]) -> str | None:
    """``None`` if ``loaded`` holds exactly ``expected``'s names with equal dtype, shape and bits, else the first
    difference."""
    if set(loaded) != set(expected):
        return f"names differ: expected {sorted(expected)}, loaded {sorted(loaded)}"
    for name, tensor in expected.items():
        got = loaded[name]
        if not isinstance(got, torch.Tensor):
            return f"{name}: loaded a {type(got).__name__}, not a tensor"
        if got.device.type != "cpu":
            return f"{name}: loaded onto {got.device}, not the CPU"
        if got.dtype != tensor.dtype or got.shape != tensor.shape:
            return f"{name}: loaded {got.dtype} {tuple(got.shape)}, expected {tensor.dtype} {tuple(tensor.shape)}"
        if not torch.equal(_bytes(got), _bytes(tensor)):
            return f"{name}: the bytes differ"
    return None


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


@functools.cache
def _unavailable(peer: Peer) -> str | None:
    try:
        importlib.import_module(peer.module)
    except ModuleNotFoundError as error:
        if peer.version() is None:
            return f"{peer.package} is not installed ({INSTALL_HINT})"
        return f"{peer.package} {peer.version()} does not import: {_one_line(error)}"
    except Exception as error:  # an import that fails for any reason (a missing CUDA library, an ABI mismatch)
        return f"{peer.package} {peer.version()} does not import: {_one_line(error)}"
    expected = smoke_state_dict()
    try:
        with tempfile.TemporaryDirectory(prefix="coldstart-peer-") as workdir:
            source = os.path.join(workdir, "smoke.safetensors")
            safetensors.torch.save_file(expected, source)
            difference = same_tensors(expected, peer.load(peer.prepare(source, workdir)))
    except Exception as error:
        return f"{peer.package} {peer.version()} cannot load into CPU memory here: {_one_line(error)}"
    if difference is not None:
        return f"{peer.package} {peer.version()} loads wrong tensors: {difference}"
    return None


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


if __name__ == "__main__":
    for peer in PEERS:
        print(f"{peer.name:22} {peer.version() or '-':10} {peer.unavailable() or 'works on this machine'}")
