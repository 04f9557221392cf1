"""Logging: the library's records (names, levels, what they say), that the library configures nothing and prints
nothing, and the console helpers the command line and the demo use (zerocopy_pickle._console)."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import zerocopy_pickle as zp
from tests.internals import console
from zerocopy_pickle.cache.protocol import DIR_ENV


@pytest.fixture
def records(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="zerocopy_pickle")
    return caplog


@pytest.fixture
def clean_console() -> Iterator[None]:
    """Undo what the console helpers do to the process's loggers."""
    ours = logging.getLogger("zerocopy_pickle")
    saved_level, saved_handlers = ours.level, list(ours.handlers)
    noisy = [logging.getLogger(name) for name, _ in console.NOISE]
    saved_filters = [list(logger.filters) for logger in noisy]
    try:
        yield
    finally:
        ours.setLevel(saved_level)
        ours.handlers[:] = saved_handlers
        for logger, filters in zip(noisy, saved_filters, strict=True):
            logger.filters[:] = filters


def _ours(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == name]


# ---------------------------------------------------------------------------------------------------------
# The library's records
# ---------------------------------------------------------------------------------------------------------


def test_dump_and_load_log_at_info_under_the_package_logger(tmp_path: Path, records: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "w.zcp"
    zp.dump({"w": torch.ones(4), "b": torch.zeros(2)}, path)
    zp.load(path)
    zp.load(path, trusted=True, verify=True)
    dumped, *loaded = _ours(records, "zerocopy_pickle._core.snapshot")
    assert dumped.levelno == logging.INFO
    message = dumped.getMessage()
    assert (
        message.startswith(f"dumped {path}: ") and "2 buffers" in message and f"{path.stat().st_size} bytes" in message
    )
    assert [r.levelno for r in loaded] == [logging.INFO, logging.INFO]
    restricted, trusted = (r.getMessage() for r in loaded)
    assert restricted.startswith(f"loaded {path}: ") and ", restricted, " in restricted and "verified" not in restricted
    assert ", trusted, verified, " in trusted
    # Logged with %-style arguments, formatted only if a handler wants the record.
    assert dumped.args and "%" in str(dumped.msg)


def test_loads_freeze_and_snapshot_load_log_at_debug(records: pytest.LogCaptureFixture) -> None:
    data = zp.dumps([torch.arange(3)])
    zp.loads(data)
    with zp.freeze(torch.ones(2)) as snap:
        snap.load()
    messages = [(r.levelno, r.getMessage().split(" ", 1)[0]) for r in _ours(records, "zerocopy_pickle._core.snapshot")]
    assert messages == [(logging.DEBUG, "loaded"), (logging.DEBUG, "froze"), (logging.DEBUG, "loaded")]


def test_nothing_is_logged_per_tensor(tmp_path: Path, records: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "many.zcp"
    zp.dump({str(i): torch.full((2,), i) for i in range(50)}, path)
    zp.load(path)
    assert len([r for r in records.records if r.name.startswith("zerocopy_pickle")]) <= 3  # dump, load, backend


def test_a_dump_to_a_file_object_names_it(tmp_path: Path, records: pytest.LogCaptureFixture) -> None:
    with open(tmp_path / "f.zcp", "wb") as f:
        zp.dump(torch.ones(1), f)
    buffer = io.BytesIO()
    zp.dump(torch.ones(1), buffer)
    names = [r.getMessage().split(":", 1)[0] for r in _ours(records, "zerocopy_pickle._core.snapshot")]
    assert names == [f"dumped {str(tmp_path / 'f.zcp')!r}", "dumped a BytesIO"]


def test_library_loggers_are_named_after_their_modules() -> None:
    from tests.internals import remote, snapshot
    from zerocopy_pickle import native
    from zerocopy_pickle.cache import client, server, store

    for module in (snapshot, native, remote, client, server, store):
        assert module.log.name == module.__name__


# ---------------------------------------------------------------------------------------------------------
# The library configures nothing and prints nothing
# ---------------------------------------------------------------------------------------------------------

_FRESH = textwrap.dedent(
    """
    import json, logging, sys, tempfile, os
    import torch
    import zerocopy_pickle as zp

    ours = logging.getLogger("zerocopy_pickle")
    report = {
        "handlers": [type(h).__name__ for h in ours.handlers],
        "root_handlers": len(logging.getLogger().handlers),
        "root_level": logging.getLogger().level,
        "level": ours.level,
    }
    ours.setLevel(logging.DEBUG)  # every record is made; with only the NullHandler none may reach stderr
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.zcp")
        zp.dump({"w": torch.ones(3)}, path)
        zp.load(path)
        zp.loads(zp.dumps([1, torch.zeros(2)]))
        zp.scan(path)
        with zp.freeze(torch.nn.Linear(2, 2)) as snap:
            snap.load()
        logging.getLogger("zerocopy_pickle.cache.store").warning("a warning record")
    report["console_imported"] = "zerocopy_pickle._console" in sys.modules
    print(json.dumps(report))
    """
)


@pytest.mark.slow
def test_import_configures_nothing_and_the_library_prints_nothing() -> None:
    proc = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # not even a WARNING record through logging's last-resort handler
    report = json.loads(proc.stdout)  # and stdout is our one line
    assert report == {
        "handlers": ["NullHandler"],
        "root_handlers": 0,
        "root_level": logging.WARNING,
        "level": logging.NOTSET,
        "console_imported": False,
    }


def test_dump_load_scan_freeze_write_nothing(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], records: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "m.zcp"
    zp.dump(torch.nn.Linear(3, 3).state_dict(), path)
    zp.load(path)
    zp.scan(path)
    zp.read_header(path)
    with zp.freeze({"t": torch.ones(2)}) as snap:
        snap.load()
    assert capfd.readouterr() == ("", "")
    assert records.records  # the records were made, and went to logging only


# ---------------------------------------------------------------------------------------------------------
# zerocopy_pickle._console: configure_logging
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("verbosity", "level"),
    [(-1, logging.ERROR), (0, logging.WARNING), (1, logging.INFO), (2, logging.DEBUG), (5, logging.DEBUG)],
)
def test_configure_logging_levels(clean_console: None, verbosity: int, level: int) -> None:
    console.configure_logging(verbosity)
    assert logging.getLogger("zerocopy_pickle").level == level


def test_configure_logging_is_idempotent_and_leaves_the_root_logger_alone(clean_console: None) -> None:
    root = logging.getLogger()
    root_state = root.level, list(root.handlers)
    before = len(logging.getLogger("zerocopy_pickle").handlers)
    console.configure_logging(0)
    console.configure_logging(2)
    assert len(logging.getLogger("zerocopy_pickle").handlers) == before + 1
    assert logging.getLogger("zerocopy_pickle").level == logging.DEBUG  # the second call's level
    assert (root.level, list(root.handlers)) == root_state


def test_configured_records_go_to_the_current_stderr(clean_console: None, capsys: pytest.CaptureFixture[str]) -> None:
    console.configure_logging(1)
    logging.getLogger("zerocopy_pickle.cache.server").info("cache serving on %s (pid %d)", "/x/server.sock", 7)
    logging.getLogger("zerocopy_pickle._core.snapshot").debug("not at verbosity 1")
    logging.getLogger("other.library").warning("not ours")
    out, err = capsys.readouterr()
    assert out == ""
    assert "INFO zerocopy_pickle.cache.server: cache serving on /x/server.sock (pid 7)" in err
    assert "not at verbosity 1" not in err and "not ours" not in err


def test_a_server_started_by_python_m_logs_its_start_and_stop(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    env = {**os.environ, DIR_ENV: str(directory)}
    server = subprocess.Popen(
        [sys.executable, "-m", "zerocopy_pickle.cache", "serve"], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert server.stderr is not None
        first = server.stderr.readline()
        assert "INFO zerocopy_pickle.cache.server: cache serving on " in first, first
        assert str(directory / "server.sock") in first
    finally:
        server.terminate()
        out, err = server.communicate(timeout=60)
    assert "INFO zerocopy_pickle.cache.server: cache stopped after " in err
    assert out == ""


# ---------------------------------------------------------------------------------------------------------
# zerocopy_pickle._console: quiet_third_party
# ---------------------------------------------------------------------------------------------------------

_BNB = "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already `pip install kernels` and the kernels >= 0.11.1"  # noqa: E501 - bitsandbytes' text, verbatim
_TORCHVISION = (
    "`CLIPImageProcessor` requires torchvision (not installed); falling back to `CLIPImageProcessorPil` for backward "
    "compatibility. Install torchvision to use the default backend, or import `CLIPImageProcessorPil` directly to "
    "silence this warning."
)


def test_quiet_third_party_drops_exactly_the_known_messages(
    clean_console: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    console.quiet_third_party()
    console.quiet_third_party()  # idempotent: one filter per logger
    for name, _ in console.NOISE:
        assert len(logging.getLogger(name).filters) == 1
    bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
    transformers = logging.getLogger("transformers.utils.import_utils")
    bnb.warning(_BNB, "No module named 'kernels'")  # as bitsandbytes logs it
    transformers.warning(_TORCHVISION)
    transformers.warning(_TORCHVISION.replace("CLIPImageProcessor", "SiglipImageProcessor"))
    # Everything else those loggers (and the others) say still passes.
    bnb.warning("Failed to load something else")
    transformers.warning("`CLIPImageProcessor` is deprecated")
    logging.getLogger("transformers").warning(_TORCHVISION)  # the same text elsewhere is not the known noise
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("bitsandbytes.backends.cpu.ops", "Failed to load something else"),
        ("transformers.utils.import_utils", "`CLIPImageProcessor` is deprecated"),
        ("transformers", _TORCHVISION),
    ]


def test_quiet_third_party_leaves_warnings_alone(clean_console: None) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        console.quiet_third_party()
        warnings.warn("still shown", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["still shown"]


_REAL = textwrap.dedent(
    """
    import importlib, inspect, logging, sys
    from zerocopy_pickle._console import NOISE
    from zerocopy_pickle._console import quiet_third_party
    if sys.argv[1] == "quiet":
        quiet_third_party()
    import bitsandbytes.backends.cpu.ops as bnb_ops
    import transformers
    import transformers.utils.import_utils as import_utils
    transformers.CLIPImageProcessor  # without torchvision: transformers' fallback warning
    # the filters sit on the loggers these modules really use, and match the text they really log
    assert bnb_ops.logger.name == NOISE[0][0], bnb_ops.logger.name
    assert import_utils.logger.name == NOISE[1][0], import_utils.logger.name
    assert "Failed to load CPU gemm_4bit_forward from kernels-community: %s." in inspect.getsource(bnb_ops)
    print("ok")
    """
)


@pytest.mark.slow
def test_the_real_third_party_noise_is_dropped() -> None:
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("transformers")
    if subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True, check=False).returncode == 0:
        pytest.skip("torchvision is installed: transformers has no fallback to warn about")
    noisy = subprocess.run([sys.executable, "-c", _REAL, "loud"], capture_output=True, text=True, timeout=300)
    quiet = subprocess.run([sys.executable, "-c", _REAL, "quiet"], capture_output=True, text=True, timeout=300)
    assert noisy.stdout.strip() == quiet.stdout.strip() == "ok", noisy.stderr + quiet.stderr
    assert "requires torchvision (not installed); falling back to" in noisy.stderr  # the noise is real here
    assert "requires torchvision" not in quiet.stderr
    assert "gemm_4bit_forward" not in quiet.stderr  # logged only on CPUs with AVX512-BF16: checked where it is
    assert quiet.stderr == ""
