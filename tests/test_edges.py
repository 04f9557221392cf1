"""The small edges of issue 26 (item 6): a load given a torch or TorchScript file says what it is and what to do;
``convert`` refuses a TorchScript archive in one line that names ``--trusted``; a dump into a missing folder names
the user's path."""

from __future__ import annotations

import io
import os
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import zerocopy_pickle as zp
from tests.conftest import REPO
from tests.internals import main, sources
from zerocopy_pickle.errors import SnapshotError

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")  # the fixture's TorchScript archive


pytestmark = pytest.mark.usefixtures("restore_logging_and_environment")


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    state = {"w": torch.arange(6.0).reshape(2, 3)}
    made = {"zip": tmp_path / "model.pt", "legacy": tmp_path / "legacy.pt", "script": tmp_path / "scripted.pt"}
    torch.save(state, made["zip"])
    torch.save(state, made["legacy"], _use_new_zipfile_serialization=False)
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), made["script"])
    return made


# -- 1. loads of torch files -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("which", "what"), [("zip", "a zip archive"), ("legacy", "the legacy format")])
def test_load_of_a_torch_save_file_says_how_to_read_and_convert_it(
    files: dict[str, Path], which: str, what: str
) -> None:
    path = files[which]
    with pytest.raises(SnapshotError) as caught:
        zp.load(path)
    message = str(caught.value)
    assert message.startswith(f"{str(path)!r} is a torch.save file ({what}), not a zerocopy_pickle snapshot")
    assert f"torch.load({str(path)!r}, weights_only=True)" in message
    out = path.with_suffix(".zcp")
    assert f"`zerocopy-pickle convert {path} {out}`" in message
    assert "\n" not in message
    # the advice works: torch.load reads it, and the command it gives makes a snapshot that loads
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.arange(6.0).reshape(2, 3))
    assert main(shlex.split(message.split("`")[1])[1:]) == 0
    assert torch.equal(zp.load(out)["w"], torch.arange(6.0).reshape(2, 3))


@pytest.mark.parametrize("which", ["zip", "legacy"])
def test_loads_of_torch_save_bytes_says_how_to_read_them(files: dict[str, Path], which: str) -> None:
    data = files[which].read_bytes()
    with pytest.raises(SnapshotError, match=r"^these bytes are a torch\.save file") as caught:
        zp.loads(data)
    assert "torch.load(io.BytesIO(data), weights_only=True)" in str(caught.value)
    assert "zerocopy-pickle convert" in str(caught.value)
    assert torch.equal(torch.load(io.BytesIO(data), weights_only=True)["w"], torch.arange(6.0).reshape(2, 3))


def test_load_of_a_torchscript_archive_says_trusted(files: dict[str, Path]) -> None:
    path = files["script"]
    with pytest.raises(SnapshotError) as caught:
        zp.load(path)
    message = str(caught.value)
    assert message.startswith(f"{str(path)!r} is a TorchScript archive (torch.jit.save), not a zerocopy_pickle")
    assert f"torch.jit.load({str(path)!r})" in message
    assert f"`zerocopy-pickle convert {path} {path.with_suffix('.zcp')} --trusted`" in message
    with pytest.raises(SnapshotError, match="TorchScript archive.*--trusted"):
        zp.loads(path.read_bytes())


def test_a_file_object_or_a_copying_load_gets_the_same_advice(files: dict[str, Path]) -> None:
    path = files["zip"]
    with pytest.raises(SnapshotError, match=r"is a torch\.save file \(a zip archive\)") as caught:
        zp.load(path, copy=True)  # read into memory: the fixed header is checked while reading
    assert f"torch.load({str(path)!r}, weights_only=True)" in str(caught.value)
    with open(path, "rb") as f, pytest.raises(SnapshotError) as caught:
        zp.load(f)  # mapped: named by its name
    assert str(caught.value).startswith(f"{str(path)!r} is a torch.save file (a zip archive)")
    with pytest.raises(SnapshotError, match=r"^not a zerocopy_pickle snapshot"):
        zp.load(io.BytesIO(path.read_bytes()))  # read as it arrives: refused from its first bytes, as before


def test_a_path_with_spaces_is_quoted_in_the_command(tmp_path: Path) -> None:
    path = tmp_path / "my model.pt"
    torch.save({"w": torch.ones(2)}, path)
    with pytest.raises(SnapshotError) as caught:
        zp.load(path)
    command = str(caught.value).split("`")[1]
    assert shlex.split(command) == ["zerocopy-pickle", "convert", str(path), str(tmp_path / "my model.zcp")]


def test_other_files_keep_the_plain_refusal(tmp_path: Path) -> None:
    """A zip that is not torch's, a truncated zip, random bytes: no torch advice."""
    plain = tmp_path / "plain.zip"
    with zipfile.ZipFile(plain, "w") as archive:
        archive.writestr("readme.txt", "hello")
    truncated = tmp_path / "truncated.pt"
    torch.save({"w": torch.ones(100)}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:200])
    junk = tmp_path / "junk.bin"
    junk.write_bytes(os.urandom(4096))
    for path in (plain, truncated, junk):
        with pytest.raises(SnapshotError) as caught:
            zp.load(path)
        assert str(caught.value).startswith("not a zerocopy_pickle snapshot"), path
        with pytest.raises(SnapshotError) as caught:
            zp.loads(path.read_bytes())
        assert str(caught.value).startswith("not a zerocopy_pickle snapshot"), path


def test_sniff_is_the_one_detection(files: dict[str, Path], tmp_path: Path) -> None:
    def kind(data: bytes) -> str | None:
        return sources.sniff(sources.at_view(memoryview(data)), len(data))

    assert kind(files["zip"].read_bytes()) == "torch.save"
    assert kind(files["legacy"].read_bytes()) == "torch.save (legacy)"
    assert kind(files["script"].read_bytes()) == "torchscript"
    assert kind(zp.dumps(torch.ones(2))) == "snapshot"
    assert kind(b"") is None
    assert kind(b"PK\x03\x04") is None
    # a zip whose central directory claims more than the data holds is no zip, not a crash
    assert kind(b"PK\x03\x04" + b"\x00" * 30 + b"PK\x05\x06" + b"\xff" * 18) is None


# -- 2. convert of a TorchScript archive ---------------------------------------------------------------------------


def test_convert_refuses_torchscript_in_one_line_naming_trusted(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.zcp"
    assert main(["convert", str(files["script"]), str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "TorchScript archive" in lines[0]
    assert "--trusted" in lines[0]
    assert "runs the TorchScript code" in lines[0]
    assert not out.exists()


@pytest.mark.slow
def test_convert_of_torchscript_in_a_subprocess_has_no_warning_or_traceback(
    files: dict[str, Path], tmp_path: Path
) -> None:
    def convert(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "zerocopy_pickle._cli", "convert", str(files["script"]), *extra],
            capture_output=True, text=True, cwd=REPO, check=False, timeout=120,
        )  # fmt: skip

    refused = convert(str(tmp_path / "a.zcp"))
    assert refused.returncode == 1
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "--trusted" in refused.stderr
    assert "Traceback" not in refused.stderr and "Warning" not in refused.stderr

    trusted = convert(str(tmp_path / "b.zcp"), "--trusted")
    assert trusted.returncode == 0, trusted.stderr
    assert "(torchscript)" in trusted.stdout
    assert "Warning" not in trusted.stderr, trusted.stderr
    loaded = zp.load(tmp_path / "b.zcp", trusted=True)
    x = torch.randn(3, 2)
    assert torch.equal(loaded(x), torch.jit.load(files["script"])(x))


# -- 3. a dump into a missing folder -------------------------------------------------------------------------------


def test_dump_into_a_missing_folder_names_the_users_path(tmp_path: Path) -> None:
    target = tmp_path / "missing" / "model.zcp"
    with pytest.raises(FileNotFoundError) as caught:
        zp.dump(torch.ones(2), target)
    assert caught.value.filename == str(target)
    assert f"the folder {str(tmp_path / 'missing')!r} does not exist" in str(caught.value)
    assert "tmp" not in str(caught.value).replace(str(tmp_path), "")  # no temporary file's name
    assert sorted(tmp_path.iterdir()) == []


def test_dump_under_a_file_says_it_is_not_a_folder(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    target = tmp_path / "file" / "model.zcp"
    with pytest.raises(NotADirectoryError) as caught:
        zp.dump(torch.ones(2), str(target))
    assert caught.value.filename == str(target)
    assert "is not a folder" in str(caught.value)


def test_sniff_reads_at_most_its_budget_of_a_zip(files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A hostile zip may claim a central directory of gigabytes: the detection stops reading and says None."""
    data = files["script"].read_bytes()
    reads: list[int] = []

    def read(offset: int, nbytes: int) -> bytes:
        reads.append(nbytes)
        return data[offset : offset + nbytes]

    monkeypatch.setattr(sources, "_MAX_ZIP_READ", 64)
    assert sources.sniff(read, len(data)) is None
    assert sum(reads[1:]) <= 64  # after the 16-byte head
    monkeypatch.undo()
    assert sources.sniff(read, len(data)) == "torchscript"


def test_load_of_a_safetensors_file_says_how_to_read_and_convert_it(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path = tmp_path / "weights.safetensors"
    safetensors_torch.save_file({"w": torch.ones(3)}, str(path))
    with pytest.raises(SnapshotError) as caught:
        zp.load(path)
    message = str(caught.value)
    assert message.startswith(f"{str(path)!r} is a safetensors file, not a zerocopy_pickle snapshot")
    assert f"safetensors.torch.load_file({str(path)!r})" in message
    assert f"`zerocopy-pickle convert {path} {tmp_path / 'weights.zcp'}`" in message
