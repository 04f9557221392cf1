"""The zerocopy-pickle command line: every command, its output and --json, its exit codes, its logging options,
and the native command over zerocopy_pickle.native.status()."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zerocopy_pickle as zp
from tests.internals import cli_exits, cli_inspection, format_global, main
from zerocopy_pickle import native
from zerocopy_pickle.cache.protocol import DIR_ENV

from .cache_helpers import private_dir, running_server
from .conftest import REPO, run_python


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed console script, as a user runs it."""
    script = shutil.which("zerocopy-pickle", path=os.path.dirname(sys.executable))
    assert script is not None, "the zerocopy-pickle console script is not installed"
    return subprocess.run([script, *args], capture_output=True, text=True, timeout=600, cwd=REPO)


pytestmark = pytest.mark.usefixtures("restore_logging_and_environment")


@pytest.fixture
def snapshot(tmp_path: Path) -> Path:
    path = tmp_path / "sd.zcp"
    zp.dump({"w": torch.ones(4, 4, dtype=torch.float16), "b": torch.arange(3), "layer": torch.nn.Linear(2, 2)}, path)
    return path


@pytest.mark.slow
def test_inspect_text(snapshot: Path) -> None:
    proc = run_cli("inspect", str(snapshot))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "format v2" in out
    assert "checksums: xxh3_64" in out
    assert "float16 32 B" in out and "int64 24 B" in out
    assert "torch.nn.modules.linear:Linear" in out
    assert "zerocopy_pickle.rebuild:rebuild_storage" in out
    assert "cpu" in out


def test_inspect_json(snapshot: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--json", str(snapshot)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format_version"] == 2
    assert report["checksums"]["algorithm"] == "xxh3_64"
    assert report["signed"] is False
    assert report["nbytes_by_dtype"]["float16"] == 32
    assert len(report["buffers"]) == 4
    assert {"offset", "nbytes", "location", "dtype", "readonly"} == set(report["buffers"][0])
    assert "torch.nn.modules.linear:Linear" in report["globals"]
    assert report["total_nbytes"] == snapshot.stat().st_size


def test_inspect_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.zcp"
    bad.write_bytes(b"x" * 100)
    assert main(["inspect", str(bad)]) == 1
    assert "not a zerocopy_pickle snapshot" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "missing")]) == 1


@pytest.mark.slow
@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
def test_convert_torch_save(tmp_path: Path, zipfile: bool) -> None:
    state = {"a": torch.randn(3, 3), "b": torch.arange(4)}
    state["tied"] = state["a"]
    src, dst = tmp_path / "m.pt", tmp_path / "m.zcp"
    torch.save(state, src, _use_new_zipfile_serialization=zipfile)
    proc = run_cli("convert", str(src), str(dst))
    assert proc.returncode == 0, proc.stderr
    assert "(torch)" in proc.stdout
    loaded = zp.load(dst)
    assert torch.equal(loaded["a"], state["a"]) and torch.equal(loaded["b"], state["b"])
    assert loaded["tied"].data_ptr() == loaded["a"].data_ptr()


def test_convert_safetensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import save_file

    state = {"x": torch.randn(5), "y": torch.ones(2, 2, dtype=torch.bfloat16)}
    src, dst = tmp_path / "m.safetensors", tmp_path / "m.zcp"
    save_file(state, src)
    assert main(["convert", str(src), str(dst)]) == 0
    assert "(safetensors)" in capsys.readouterr().out
    loaded = zp.load(dst)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


class Custom:
    def __init__(self) -> None:
        self.t = torch.ones(2)


def test_convert_untrusted_torch_file_needs_trusted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, dst = tmp_path / "c.pt", tmp_path / "c.zcp"
    torch.save({"obj": Custom()}, src)
    assert main(["convert", str(src), str(dst)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, not torch's page of advice
    assert f"GLOBAL {__name__}.Custom was not an allowed global" in err and "--trusted" in err
    assert not dst.exists()
    assert main(["convert", "--trusted", str(src), str(dst)]) == 0
    assert zp.load(dst, allow=[Custom])["obj"].t.sum() == 2


def test_convert_refuses_garbage_and_snapshots(
    tmp_path: Path, snapshot: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    garbage = tmp_path / "g.bin"
    garbage.write_bytes(b"\x00" * 50)
    assert main(["convert", str(garbage), str(tmp_path / "o.zcp")]) == 1
    assert "cannot read" in capsys.readouterr().err
    assert main(["convert", str(snapshot), str(tmp_path / "o.zcp")]) == 1
    assert "already a zerocopy_pickle snapshot" in capsys.readouterr().err


@pytest.mark.slow
def test_snapshot_demo_runs_small() -> None:
    proc = run_cli("demo", "--snapshot", "--size-mb", "40", "--repeat", "1")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for method in ("torch.save / torch.load", "safetensors", "zerocopy_pickle dump / load", "whole nn.Module"):
        assert method in out
    assert "outputs identical" in out


COMMANDS = ("inspect", "scan", "convert", "native", "serve", "status", "stop", "clear", "demo")


def test_help_lists_commands_exit_codes_and_environment() -> None:
    proc = run_cli("--help")
    assert proc.returncode == 0
    for command in COMMANDS:
        assert f"\n    {command} " in proc.stdout
    assert "examples:\n  zerocopy-pickle " in proc.stdout
    table = proc.stdout.split("exit codes:\n", 1)[1].split("\n\n", 1)[0]
    codes = [int(line.split()[0]) for line in table.splitlines()]
    assert codes == [
        cli_exits.EXIT_OK,
        cli_exits.EXIT_ERROR,
        cli_exits.EXIT_USAGE,
        cli_exits.EXIT_REFUSED,
        cli_exits.EXIT_INTEGRITY,
        cli_exits.EXIT_NO_SERVER,
        cli_exits.EXIT_INTERRUPTED,
    ]
    assert codes == [0, 1, 2, 3, 4, 5, 130]  # what scripts rely on: changing one breaks them
    for variable in (native.ENV, native.CACHE_ENV, DIR_ENV):
        assert variable in proc.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_a_description_and_examples(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    usage, description = out.split("\n\n")[:2]
    assert usage.startswith(f"usage: zerocopy-pickle {command} ")
    assert len(description) > 40  # says what the command does, not just its name
    examples = out.split("\nexamples:\n", 1)[1]
    assert f"  zerocopy-pickle {command}" in examples
    assert "-v, --verbose" in out and "-q, --quiet" in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"zerocopy-pickle {zp.__version__}\n"


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["inspect"],
        ["inspect", "a", "b"],
        ["frobnicate"],
        ["scan", "--nope", "f"],
        ["-v", "-q", "native"],
        ["serve", "--fill-delay", "soon", "30"],
        ["serve", "--fill-delay", "-1", "30"],
        ["serve", "--fill-delay", "1"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == cli_exits.EXIT_USAGE == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: zerocopy-pickle") and "error: " in err


# --- exit codes and how errors are reported -------------------------------------------------------------------


def test_errors_are_one_line_on_stderr_and_json_on_stdout_with_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.zcp"
    for command in ("inspect", "scan"):
        assert main([command, str(missing)]) == cli_exits.EXIT_ERROR == 1
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err.startswith(f"zerocopy-pickle {command}: error: ") and captured.err.count("\n") == 1
        assert "No such file" in captured.err and "Traceback" not in captured.err
        assert main([command, "--json", str(missing)]) == 1
        captured = capsys.readouterr()
        report = json.loads(captured.out)
        assert set(report) == {"error", "exit_code"} and report["exit_code"] == 1
        assert report["error"] in captured.err


def test_interrupted_exits_130(
    snapshot: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_inspection, "run_inspect", interrupted)
    assert main(["inspect", str(snapshot)]) == cli_exits.EXIT_INTERRUPTED == 130
    assert capsys.readouterr().err == "zerocopy-pickle inspect: interrupted\n"


@pytest.mark.slow
def test_a_closed_stdout_ends_quietly(snapshot: Path) -> None:
    """`zerocopy-pickle inspect F | head -1`: the reader leaves before the output is written."""
    script = shutil.which("zerocopy-pickle", path=os.path.dirname(sys.executable))
    assert script is not None
    proc = subprocess.Popen(
        [script, "inspect", str(snapshot)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the child, still importing, writes anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=600) == cli_exits.EXIT_ERROR
    assert err == ""  # no "Broken pipe" error line, no traceback at exit


def damaged(snapshot: Path, tmp_path: Path, region: str) -> Path:
    """A copy of ``snapshot`` with one byte flipped in its stream or its first buffer."""
    header = zp.read_header(snapshot)
    data = bytearray(snapshot.read_bytes())
    at = header.stream_offset + header.stream_nbytes - 2 if region == "stream" else header.data_offset
    data[at] ^= 0x01
    path = tmp_path / f"damaged-{region}.zcp"
    path.write_bytes(bytes(data))
    return path


def test_integrity_failures_exit_4(snapshot: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stream, buffer = damaged(snapshot, tmp_path, "stream"), damaged(snapshot, tmp_path, "buffer")
    # scan checks the stream as a load does; inspect reads the header only unless --verify
    assert main(["scan", str(stream)]) == cli_exits.EXIT_INTEGRITY == 4
    assert "does not match its checksum" in capsys.readouterr().err
    assert main(["scan", str(buffer)]) == 3  # the stream is intact; it names a class (Linear) no load allows
    assert main(["inspect", str(buffer)]) == 0
    capsys.readouterr()
    assert main(["inspect", "--verify", str(buffer)]) == 4
    assert "buffer 0 at " in capsys.readouterr().err
    assert main(["inspect", "--verify", "--json", str(stream)]) == 4
    assert json.loads(capsys.readouterr().out)["exit_code"] == 4
    with pytest.raises(zp.IntegrityError):  # what a load says of the same file
        zp.load(buffer, verify=True, allow=[torch.nn.Linear])


def test_inspect_verify_passes_on_an_intact_snapshot(snapshot: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--verify", str(snapshot)]) == 0
    assert "(verified: all match)" in capsys.readouterr().out
    assert main(["inspect", "--verify", "--json", str(snapshot)]) == 0
    assert json.loads(capsys.readouterr().out)["verified"] is True


# --- scan ---------------------------------------------------------------------------------------------------------


def test_scan_says_what_a_restricted_load_refuses(snapshot: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["scan", str(snapshot)]) == cli_exits.EXIT_REFUSED == 3
    out = capsys.readouterr().out
    assert "  refused  torch.nn.modules.linear:Linear\n" in out
    assert "  allowed  zerocopy_pickle.rebuild:rebuild_storage\n" in out
    assert "restricted load: refused: " in out and "allow=['torch.nn.modules.linear:Linear']" in out
    with pytest.raises(zp.RestrictedLoadError):
        zp.load(snapshot)

    assert main(["scan", str(snapshot), "--allow", "torch.nn.modules.linear:Linear"]) == 0
    out = capsys.readouterr().out
    assert "refused" not in out
    assert out.endswith("restricted load with --allow torch.nn.modules.linear:Linear: accepted\n")
    assert isinstance(zp.load(snapshot, allow=["torch.nn.modules.linear:Linear"])["layer"], torch.nn.Linear)


def test_scan_json(snapshot: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["scan", "--json", str(snapshot)]) == 3
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"file", "allow", "globals", "restricted"}
    assert report["file"] == str(snapshot) and report["allow"] == []
    assert [g["name"] for g in report["globals"]] == [format_global(p) for p in zp.scan(snapshot)]
    assert all(set(g) == {"name", "module", "qualname", "status"} for g in report["globals"])
    statuses = {g["name"]: g["status"] for g in report["globals"]}
    assert statuses.pop("torch.nn.modules.linear:Linear") == "refused"
    assert set(statuses.values()) == {"allowed"}
    restricted = report["restricted"]
    assert set(restricted) == {"accepted", "refused", "blocked", "message"}
    assert restricted["accepted"] is False and restricted["refused"] == ["torch.nn.modules.linear:Linear"]
    assert restricted["blocked"] == [] and "not on this load's allow-list" in restricted["message"]

    plain = tmp_path / "plain.zcp"
    zp.dump({"t": torch.arange(3)}, plain)
    assert main(["scan", "--json", str(plain)]) == 0
    restricted = json.loads(capsys.readouterr().out)["restricted"]
    assert restricted == {"accepted": True, "refused": [], "blocked": [], "message": None}


def test_scan_reports_blocked_globals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "hostile.zcp"
    zp.dump({"run": os.system, "t": torch.ones(1)}, path)
    # --allow cannot lift the blocklist: the load's own rule, not the scan's
    assert main(["scan", "--json", str(path), "--allow", f"{os.system.__module__}:system"]) == 3
    report = json.loads(capsys.readouterr().out)
    blocked = f"{os.system.__module__}:system"
    assert {g["name"]: g["status"] for g in report["globals"]}[blocked] == "blocked"
    assert report["restricted"]["blocked"] == [blocked]
    with pytest.raises(zp.RestrictedLoadError, match="blocklist"):
        zp.load(path, allow=[blocked])


def test_scan_refuses_a_use_that_no_name_explains(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A stream that calls a value of the safe set names only allowed globals: the refusal is of the use."""
    from .hostile_streams import as_snapshot

    stream = b"\x80\x05ctorch\nfloat32\n)R."  # GLOBAL torch.float32, EMPTY_TUPLE, REDUCE: calls a dtype
    path = tmp_path / "calls-a-dtype.zcp"
    path.write_bytes(as_snapshot(stream, []))
    with pytest.raises(zp.RestrictedLoadError) as refused:
        zp.load(path)
    assert main(["scan", "--json", str(path)]) == 3
    report = json.loads(capsys.readouterr().out)
    assert [g["status"] for g in report["globals"]] == ["allowed"]
    assert report["restricted"]["accepted"] is False
    assert report["restricted"]["message"] == str(refused.value)


def by_value_with_a_blocked_global() -> bytes:
    """A stream that names ``posix:system`` and, as cloudpickle's streams do, calls the result of
    ``cloudpickle.cloudpickle:_builtin_type``: its analysis refuses it before any name is checked."""
    from .hostile_streams import G, call, program

    return program(
        [
            call(G("posix", "system"), "true"),
            call(call(G("cloudpickle.cloudpickle", "_builtin_type"), "CodeType"), 0),
            G("zerocopy_pickle.rebuild", "rebuild_storage"),
        ]
    )


def test_scan_labels_a_blocked_global_blocked_beside_code_pickled_by_value(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from .hostile_streams import as_snapshot

    path = tmp_path / "by-value.zcp"
    path.write_bytes(as_snapshot(by_value_with_a_blocked_global()))
    with pytest.raises(zp.RestrictedLoadError, match="pickled by value"):
        zp.load(path)
    for allow in ([], ["--allow", "posix:system", "--allow", "cloudpickle.cloudpickle:_builtin_type"]):
        assert main(["scan", str(path), *allow]) == cli_exits.EXIT_REFUSED
        out = capsys.readouterr().out
        assert "  blocked  posix:system\n" in out
        assert "  blocked  cloudpickle.cloudpickle:_builtin_type\n" in out  # cloudpickle is on the blocklist
        assert "  allowed  zerocopy_pickle.rebuild:rebuild_storage\n" in out
        assert "allowed  posix" not in out and "pickled by value" in out
        assert main(["scan", "--json", str(path), *allow]) == cli_exits.EXIT_REFUSED
        report = json.loads(capsys.readouterr().out)
        statuses = {g["name"]: g["status"] for g in report["globals"]}
        assert statuses == {
            "posix:system": "blocked",
            "cloudpickle.cloudpickle:_builtin_type": "blocked",
            "zerocopy_pickle.rebuild:rebuild_storage": "allowed",
        }
        assert report["restricted"]["accepted"] is False


def test_scan_labels_a_real_cloudpickle_stream_with_os_system(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cloudpickle = pytest.importorskip("cloudpickle")
    target = str(tmp_path / "PWNED")

    def run() -> None:  # a local function: cloudpickle pickles it by value
        open(target, "w").close()

    from .hostile_streams import as_snapshot

    path = tmp_path / "cloudpickle.zcp"
    path.write_bytes(as_snapshot(cloudpickle.dumps([run, os.system])))
    assert main(["scan", "--json", str(path)]) == cli_exits.EXIT_REFUSED
    report = json.loads(capsys.readouterr().out)
    statuses = {g["name"]: g["status"] for g in report["globals"]}
    assert statuses[f"{os.system.__module__}:system"] == "blocked"
    assert "allowed" not in {status for name, status in statuses.items() if name.startswith("cloudpickle")}
    assert not (tmp_path / "PWNED").exists()


def _load_allow_list(data: bytes, allow: list[str]) -> object:
    """The allow-list a restricted load of the snapshot ``data`` builds (the load core's own)."""
    from tests.internals import restricted_allow_list

    header = zp.read_header(data)
    return restricted_allow_list(allow, zp.default_registry(), [p.name for p in header.plugins])


def test_scan_labels_agree_with_the_load_over_the_hostile_corpus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every payload of the hostile corpus, scanned with no --allow and with --allow naming all it asks for: a
    global scan labels ``allowed`` is admitted by the load's allow-list and is not blocked; one the load refuses
    (its error's refused, needed and blocked) or the blocklist names is never labelled ``allowed``."""
    import types as _types

    from tests.internals import is_blocked

    from .hostile_streams import as_snapshot
    from .test_hostile import ALIAS_MODULE, PAYLOADS

    sentinel = tmp_path / "PWNED"
    alias = _types.ModuleType(ALIAS_MODULE)
    alias.run = os.system  # type: ignore[attr-defined]
    sys.modules[ALIAS_MODULE] = alias
    checked = 0
    try:
        for name, payload in sorted(PAYLOADS.items()):
            try:
                stream = payload(sentinel)
            except pytest.skip.Exception:
                continue
            data = as_snapshot(stream)
            path = tmp_path / "payload.zcp"
            path.write_bytes(data)
            try:
                names = [format_global(p) for p in zp.scan(data) if p != ("<dynamic>", "<dynamic>")]
            except zp.SnapshotError:  # malformed (a second stream after STOP): scan refuses the file itself
                assert main(["scan", str(path)]) == cli_exits.EXIT_ERROR
                capsys.readouterr()
                continue
            for allow in ([], names):
                code = main(["scan", "--json", str(path), *(arg for n in allow for arg in ("--allow", n))])
                report = json.loads(capsys.readouterr().out)
                assert code == cli_exits.EXIT_REFUSED, (name, report)
                statuses = {(g["module"], g["qualname"]): g["status"] for g in report["globals"]}
                with pytest.raises((zp.RestrictedLoadError, zp.SnapshotError)) as refused:
                    zp.loads(data, allow=allow)
                error = refused.value
                if isinstance(error, zp.RestrictedLoadError):
                    load_refuses = {*error.needed, *error.blocked}  # (its .refused may be a use, not a name)
                    for pair in load_refuses:
                        assert statuses.get(pair, "absent") != "allowed", (name, pair)
                    for pair in error.blocked:
                        assert statuses[pair] == "blocked", (name, pair)
                allow_list = _load_allow_list(data, allow)
                for pair, status in statuses.items():
                    if is_blocked(pair):
                        assert status == "blocked", (name, pair)
                    if status == "allowed":
                        allow_list.find_class(*pair)  # type: ignore[attr-defined]  # raises if the load would not admit it
                        assert not is_blocked(pair), (name, pair)
                checked += 1
                assert not sentinel.exists(), name
    finally:
        del sys.modules[ALIAS_MODULE]
    assert checked >= 60


# --- text from a file is shown escaped --------------------------------------------------------------------------

# ESC sequences (clear the screen, retitle the window, ring the bell), the one-byte CSI, backspace, carriage return,
# the bidirectional overrides and isolates, a zero-width joiner, a line separator, DEL.
HOSTILE = "\x1b[2J\x1b]0;owned\x07\x9b31m\x08\r\u202eevil\u202c\u2066x\u2069\u202a\u200d\u2028\x7f"
RAW_CONTROLS = ("\x1b", "\x9b", "\x07", "\x08", "\r", "\u202e", "\u202c", "\u2066", "\u2069", "\u202a", "\u200d",
                "\u2028", "\x7f")  # fmt: skip


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (
            "plain text: torch.nn.modules.linear:Linear 2.1.0+cu121",
            "plain text: torch.nn.modules.linear:Linear 2.1.0+cu121",
        ),
        ("\x1b[31mred", "\\x1b[31mred"),
        ("\x9b2J", "\\x9b2J"),
        (
            "bell\x07 back\x08 cr\r nl\n tab\t nul\x00 del\x7f",
            "bell\\x07 back\\x08 cr\\r nl\\n tab\\t nul\\x00 del\\x7f",
        ),
        ("\u202aa\u202bb\u202cc\u202dd\u202ee", "\\u202aa\\u202bb\\u202cc\\u202dd\\u202ee"),
        ("\u2066a\u2067b\u2068c\u2069", "\\u2066a\\u2067b\\u2068c\\u2069"),
        (
            "zero\u200bwidth\ufeff sep\u2028 nbsp\xa0 tag\U000e0001",
            "zero\\u200bwidth\\ufeff sep\\u2028 nbsp\\xa0 tag\\U000e0001",
        ),
        ("lone \udcff surrogate", "lone \\udcff surrogate"),
        ("a literal \\x1b stays distinct", "a literal \\\\x1b stays distinct"),
        ("unicode is kept: é, 中文, Ω", "unicode is kept: é, 中文, Ω"),
    ],
)
def test_printable_escapes_every_character_that_drives_a_terminal(text: str, shown: str) -> None:
    from tests.internals import printable

    assert printable(text) == shown
    assert printable(text).isprintable()
    assert printable(text, keep="\n") == shown.replace("\\n", "\n") if "\\\\" not in shown else True


def hostile_snapshot(tmp_path: Path, plugins: list[tuple[str, str]] = ()) -> Path:  # type: ignore[assignment]
    """A snapshot whose global names (GLOBAL: no newline; STACK_GLOBAL: anything, a forged line included) and
    header producer hold terminal control sequences."""
    from tests.internals import format as fmt

    from .hostile_streams import SG, G, program

    stream = program([G("mod" + HOSTILE, "Name" + HOSTILE), SG("m\n  allowed  forged", "q" + HOSTILE + "\n")])
    layout = fmt.encode(
        len(stream),
        [],
        plugins=[fmt.PluginRef(*p) for p in plugins],
        producer={"zerocopy_pickle": HOSTILE, "k" + HOSTILE: "1"},
    )
    path = tmp_path / "hostile.zcp"
    path.write_bytes(layout.prefix + stream + bytes(layout.data_offset - layout.stream_offset - len(stream)))
    return path


def assert_escaped(text: str) -> None:
    for raw in RAW_CONTROLS:
        assert raw not in text, repr(raw)
    assert "\\x1b[2J" in text and "\\u202eevil" in text and "\\x9b31m" in text
    assert not any(line.lstrip().startswith("allowed  forged") for line in text.splitlines())


def test_inspect_and_scan_print_the_file_s_strings_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = hostile_snapshot(tmp_path)
    assert main(["inspect", str(path)]) == cli_exits.EXIT_OK
    out = capsys.readouterr().out
    assert_escaped(out)
    assert "written by: " in out and "zerocopy_pickle \\x1b[2J" in out
    assert "    mod\\x1b[2J" in out and "    m\\n  allowed  forged:q\\x1b[2J" in out
    assert main(["scan", str(path)]) == cli_exits.EXIT_REFUSED
    out = capsys.readouterr().out
    assert_escaped(out)
    assert "  refused  m\\n  allowed  forged:q" in out
    assert "restricted load: refused: " in out  # the refusal quotes the names: escaped too


def test_json_output_is_ascii_and_keeps_the_strings_exactly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = hostile_snapshot(tmp_path)
    assert main(["inspect", "--json", str(path)]) == cli_exits.EXIT_OK
    out = capsys.readouterr().out
    assert out.isascii() and all(c == "\n" or " " <= c <= "~" for c in out)
    report = json.loads(out)
    assert report["producer"] == {"zerocopy_pickle": HOSTILE, "k" + HOSTILE: "1"}
    assert report["globals"] == ["mod" + HOSTILE + ":Name" + HOSTILE, "m\n  allowed  forged:q" + HOSTILE + "\n"]
    assert main(["scan", "--json", str(path)]) == cli_exits.EXIT_REFUSED
    out = capsys.readouterr().out
    assert out.isascii() and all(c == "\n" or " " <= c <= "~" for c in out)
    report = json.loads(out)
    assert [g["qualname"] for g in report["globals"]] == ["Name" + HOSTILE, "q" + HOSTILE + "\n"]
    assert "refusing to load global 'mod\\x1b[2J" in report["restricted"]["message"]  # the load's repr of it


def test_an_error_quoting_the_file_is_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A plugin the header names and nobody installed: the error line quotes its name."""
    path = hostile_snapshot(tmp_path, plugins=[("plug" + HOSTILE, "pkg" + HOSTILE)])
    assert main(["inspect", str(path)]) == cli_exits.EXIT_OK
    out = capsys.readouterr().out
    assert_escaped(out)
    assert "plugins:   plug\\x1b[2J" in out
    assert main(["scan", str(path)]) == cli_exits.EXIT_ERROR
    captured = capsys.readouterr()
    assert captured.err.startswith("zerocopy-pickle scan: error: ") and captured.err.count("\n") == 1
    assert "pip install pkg\\x1b[2J" in captured.err
    for raw in RAW_CONTROLS:
        assert raw not in captured.err
    assert main(["scan", "--json", str(path)]) == cli_exits.EXIT_ERROR
    captured = capsys.readouterr()
    assert captured.out.isascii() and "pip install pkg" + HOSTILE in json.loads(captured.out)["error"]


def test_log_records_are_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.internals import configure_logging, printable

    configure_logging(0)
    logging.getLogger("zerocopy_pickle.test").warning("a name from a file: %s\nsecond line", HOSTILE)
    err = capsys.readouterr().err
    for raw in RAW_CONTROLS:
        assert raw not in err
    assert err == f"WARNING zerocopy_pickle.test: a name from a file: {printable(HOSTILE)}\nsecond line\n"


# --- native ---------------------------------------------------------------------------------------------------------


def test_native_status_line_matches_the_library(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["native"]) == 0
    state = native.status()
    line = capsys.readouterr().out
    assert line.startswith(f"native: {state.backend} ({state.reason}")
    assert line.count("\n") == 1
    assert main(["native", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == {
        "backend": state.backend,
        "mode": state.mode,
        "reason": state.reason,
        "extension_path": str(state.extension_path),
        "built": state.built,
        "build": None,
    }
    with native.use("python"):
        assert main(["native"]) == 0
    assert (
        capsys.readouterr().out == "native: python (chosen by zerocopy_pickle.native.use('python') in this process)\n"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({native.ENV: "0"}, "native: python (ZEROCOPY_PICKLE_NATIVE=0)"),
        ({native.ENV: "python"}, "native: python (ZEROCOPY_PICKLE_NATIVE=python)"),
        (
            {native.ENV: "", native.CACHE_ENV: "{empty}"},
            f"native: python (auto: no cached build for torch {torch.__version__}, Python "
            f"{sys.version_info.major}.{sys.version_info.minor}; build them once: zerocopy-pickle native --build)",
        ),
        ({native.ENV: "sometimes"}, "zerocopy-pickle native: error: ZEROCOPY_PICKLE_NATIVE='sometimes': expected 0"),
    ],
    ids=["off", "python", "auto-nothing-built", "invalid"],
)
def test_native_says_why(env: dict[str, str], expected: str, tmp_path: Path) -> None:
    env = {k: v.replace("{empty}", str(tmp_path / "cache")) for k, v in env.items()}
    proc = run_python("import sys; from zerocopy_pickle._cli import main; sys.exit(main(sys.argv[1:]))", "native",
                      env=env, check=False)  # fmt: skip
    if expected.startswith("zerocopy-pickle"):
        assert proc.returncode == 1 and proc.stdout == ""
        assert proc.stderr.startswith(expected) and proc.stderr.count("\n") == 1
    else:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == expected + "\n"
    assert not (tmp_path / "cache").exists()  # asking never builds


@pytest.mark.slow
def test_native_reports_a_broken_cached_build(tmp_path: Path) -> None:
    code = """
    import sys
    from zerocopy_pickle import native
    from zerocopy_pickle._cli import main
    native.extension_path().parent.mkdir(parents=True)
    native.extension_path().write_bytes(b"not a shared object")
    sys.exit(main(["native"]))
    """
    proc = run_python(code, env={native.ENV: "", native.CACHE_ENV: str(tmp_path / "cache")})
    assert proc.stdout.startswith("native: python (auto: the cached build at ")
    assert "could not be loaded" in proc.stdout
    assert proc.stdout.endswith("; rebuild it: zerocopy-pickle native --build --force)\n")
    assert "NativeWarning" not in proc.stderr  # the status line says it once


def test_native_build(capsys: pytest.CaptureFixture[str]) -> None:
    """A real build (or the cached one): where it is, and the backend it makes active."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None or (shutil.which("ninja") is None and not _has_ninja_wheel()):
        pytest.skip("no C++ compiler or ninja: the native helpers cannot be built here")
    cached = native.extension_path().is_file()
    assert main(["native", "--build"]) == 0
    lines = capsys.readouterr().out.splitlines()
    path = native.extension_path()
    assert path.is_file()
    if cached:
        assert lines[0] == f"the native helpers were already built: {path}"
    else:
        assert lines[0].startswith("built the native helpers in ") and lines[0].endswith(f" s: {path}")
    assert lines[1] == f"native: {native.status().backend} ({native.status().reason})"
    assert main(["native", "--build", "--json"]) == 0
    build = json.loads(capsys.readouterr().out)["build"]
    assert build["path"] == str(path) and build["compiled"] is False and build["seconds"] >= 0


@pytest.mark.slow
def test_native_build_compiles_and_reports_the_cached_path(tmp_path: Path) -> None:
    """A real compile (of a tiny stand-in source) into an empty cache: the lines name the file that stays in
    the cache, not the build folder it was compiled in."""
    from .test_native import TINY_EXTENSION, _toolchain_missing

    missing = _toolchain_missing()
    if missing is not None:
        pytest.skip(f"native helpers cannot be built here: {missing}")
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY_EXTENSION)
    code = """
    import sys
    from pathlib import Path
    from zerocopy_pickle import native
    from zerocopy_pickle._cli import main
    native._SOURCE = Path(sys.argv[1])
    code = main(["native", "--build"])
    print(native.extension_path())
    sys.exit(code)
    """
    proc = run_python(code, str(source), env={native.ENV: "", native.CACHE_ENV: str(tmp_path / "cache")})
    built, status, path = proc.stdout.splitlines()
    assert Path(path).is_file() and Path(path).is_relative_to(tmp_path / "cache")
    assert built.startswith("built the native helpers in ") and built.endswith(f" s: {path}")
    assert status == f"native: native (auto: cached build at {path})"


def _has_ninja_wheel() -> bool:
    try:
        import ninja  # noqa: F401
    except ImportError:
        return False
    return True


def test_native_build_failure_exits_1(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def no_compiler(force: bool = False) -> Path:
        raise native.NativeBuildError("cannot build the native helpers: no C++ compiler ('c++' is not on PATH)")

    monkeypatch.setattr(native, "build", no_compiler)
    assert main(["native", "--build"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "zerocopy-pickle native: error: cannot build the native helpers: no C++ compiler ('c++' is not on PATH)\n"
    )
    assert main(["native", "--build", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["exit_code"] == 1


# --- the cache's commands --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["status", "stop", "clear"])
def test_no_cache_server_exits_5(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with private_dir() as directory:
        # no directory at all, a directory without a socket, and a socket nobody listens on (a dead server's)
        monkeypatch.setenv(DIR_ENV, str(directory / "absent"))
        assert main([command]) == cli_exits.EXIT_NO_SERVER == 5
        assert capsys.readouterr().err.startswith(f"zerocopy-pickle {command}: error: no cache server is running (")
        monkeypatch.setenv(DIR_ENV, str(directory))
        assert main([command]) == 5
        assert capsys.readouterr().err == (
            f"zerocopy-pickle {command}: error: no cache server is running at {directory / 'server.sock'}\n"
        )
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
            dead.bind(str(directory / "server.sock"))
        assert main([command, *(["--json"] if command == "status" else [])]) == 5
        captured = capsys.readouterr()
        assert captured.err.startswith(f"zerocopy-pickle {command}: error: no cache server is running at ")
        if command == "status":
            assert json.loads(captured.out)["exit_code"] == 5


def test_the_cache_modules_own_entry_uses_the_same_codes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m zerocopy_pickle.cache`` (what a patched client starts) runs without the top-level CLI."""
    from zerocopy_pickle.cache import cli as cache_cli

    with private_dir() as directory:
        monkeypatch.setenv(DIR_ENV, str(directory))
        assert cache_cli.main(["status"]) == cache_cli.EXIT_NO_SERVER == cli_exits.EXIT_NO_SERVER
        assert capsys.readouterr().err.startswith("zerocopy-pickle status: error: no cache server is running at ")

        def interrupted() -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr("zerocopy_pickle.cache.stop", interrupted)
        assert cache_cli.main(["stop"]) == cache_cli.EXIT_INTERRUPTED == 130


def test_cache_commands_against_a_running_server(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with running_server() as server:
        monkeypatch.setenv(DIR_ENV, str(server.directory))
        assert main(["status"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"zerocopy_pickle cache: server pid {server.pid}, ") and "0 entries" in out
        assert main(["status", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["pid"] == server.pid and report["entries"] == [] and report["hits"] == 0
        assert main(["clear"]) == 0
        assert capsys.readouterr().out == "zerocopy_pickle cache: dropped 0 entries\n"
        assert main(["stop"]) == 0
        assert capsys.readouterr().out == "zerocopy_pickle cache stopped\n"
        assert server.process.wait(timeout=30) == 0
    assert main(["status"]) == 5


def test_the_parser_and_the_console_import_no_torch() -> None:
    """`serve` must not import torch: nothing main() does before the command runs may import it."""
    proc = run_python(
        """
        import sys
        from zerocopy_pickle._cli import main
        try:
            main(["-v", "serve", "--help"])
        except SystemExit:
            pass
        print(sorted(m for m in ("torch", "numpy") if m in sys.modules))
        """
    )
    assert proc.stdout.splitlines()[-1] == "[]"


# --- logging options ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "level"),
    [([], logging.WARNING), (["-v"], logging.INFO), (["-vv"], logging.DEBUG), (["--verbose"] * 3, logging.DEBUG),
     (["-q"], logging.ERROR), (["-v", "@", "-v"], logging.DEBUG), (["@", "-q"], logging.ERROR)],
)  # fmt: skip
def test_verbosity_options_set_the_library_loggers_level(
    options: list[str], level: int, snapshot: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``@`` marks where the command's name goes: the options work before it, after it, or both."""
    if "@" not in options:
        options = [*options, "@"]
    at = options.index("@")
    argv = [*options[:at], "inspect", *options[at + 1 :], str(snapshot)]
    assert main(argv) == 0
    logger = logging.getLogger("zerocopy_pickle")
    assert logger.level == level
    logging.getLogger("zerocopy_pickle._core.snapshot").info("an info record")
    logging.getLogger("zerocopy_pickle._core.snapshot").error("an error record")
    err = capsys.readouterr().err
    assert ("an info record" in err) == (level <= logging.INFO)
    assert "an error record" in err
