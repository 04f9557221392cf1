"""Where the test suite's CPU goes: a py-spy profile of a pytest run, summed by the kind of process that spent it
(pytest workers, the test zygote's preloads, the client scripts it forks, fresh interpreters, cache servers and
their loaders) and, within each, by import against everything else; then the modules whose import cost most and
the functions that were running most.

On a 2-core machine the parallel suite is CPU-bound (four workers, and the interpreters, servers and zygotes they
start), so its wall time falls only with the CPU it spends: this says where to cut. py-spy is not a dependency of
the project; install it into the venv first (``.venv/bin/pip install py-spy``). Run from the repository root::

    python3 benchmarks/suite_cpu.py record /tmp/suite.raw -- -n 4 --dist worksteal   # then pytest's arguments
    python3 benchmarks/suite_cpu.py report /tmp/suite.raw

``record`` samples every process of the run 10 times a second (``--rate``) without stopping them
(``--nonblocking``: the run's behaviour is unchanged, its wall time a few percent longer). A sample is one process
seen running, so a kind's share of samples is its share of the suite's CPU.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

_RECORD = re.compile(r"(.*?) (\d+)\n(?=process |\Z)", re.S)  # py-spy's raw format: "frame;frame;... count"
_PROCESS = re.compile(r'process \d+:"')
# A command line ends at the quote before the first frame ("name (file:line)"): it may hold quotes and ";" itself.
_COMMAND_END = re.compile(r'"(?:;(?=[^;\n]* \([^;]*:\d+\))|$)')


def _split(stack: str) -> tuple[str, list[str]]:
    """A sampled stack's process command line and its Python frames (outermost first)."""
    starts = list(_PROCESS.finditer(stack))
    if not starts:
        return "", stack.split(";")
    end = _COMMAND_END.search(stack, starts[-1].end())
    command = stack[starts[-1].end() : end.start() if end else len(stack)]
    rest = stack[end.end() :] if end else ""
    return command.replace("\n", " "), [frame for frame in rest.split(";") if frame]


def kind(command: str, frames: list[str]) -> str:
    """The kind of process a sample ran in, from its command line and frames."""
    if "read_exactly" in command:  # tests/zygote.py's server, or a child it forked for a script
        if any(frame.startswith("run_script (") for frame in frames):
            return "zygote child (a client script)"
        return "test zygote (its preloads)"
    if "zerocopy_pickle.cache.loader" in command:
        return "cache loader"
    if "zerocopy_pickle.cache" in command and "serve" in command:
        return "cache server"
    # Not "pytest" anywhere in the command line: a script's arguments name pytest's temporary folders.
    if "exec(eval(sys.stdin.readline()))" in command or " -m pytest" in command:
        return "pytest (the workers and the main process)"
    if " -c " in command:
        return "fresh interpreter (python -c)"
    return "other: " + (command[:60] or "(no command line)")


def report(path: Path, top: int) -> None:
    records = [(stack, int(count)) for stack, count in _RECORD.findall(path.read_text())]
    total = sum(count for _, count in records)
    if not total:
        raise SystemExit(f"{path}: no samples")
    kinds: collections.Counter[str] = collections.Counter()
    imports: collections.Counter[str] = collections.Counter()
    modules: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    for stack, count in records:
        command, frames = _split(stack)
        name = kind(command, frames)
        kinds[name] += count
        leaves[frames[-1][:100] if frames else "(in native code: no Python frame)"] += count
        if any("_find_and_load" in frame for frame in frames):
            imports[name] += count
            # The first module imported below the importing script's own code: what to preload, or not import.
            imported = [f for f in frames if f.startswith("<module> (") and "<string>" not in f]
            if len(imported) > 1:
                modules[imported[1].split(" (", 1)[1].split(":", 1)[0]] += count
    print(f"{total} samples ({path})\n")
    print(f"{'share':>6} {'of it imports':>14}  kind of process")
    for name, count in kinds.most_common():
        print(f"{count / total:6.1%} {imports[name] / count:14.0%}  {name}")
    print(f"\nthe modules whose imports cost most (share of all samples), top {top}:")
    for module, count in modules.most_common(top):
        print(f"{count / total:6.1%}  {module}")
    print(f"\nthe functions running most (share of all samples), top {top}:")
    for leaf, count in leaves.most_common(top):
        print(f"{count / total:6.1%}  {leaf}")


def record(path: Path, rate: int, pytest_args: list[str]) -> None:
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        raise SystemExit("py-spy is not installed: .venv/bin/pip install py-spy")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # as make test runs it
    env["ZEROCOPY_PICKLE_STRICT_SKIPS"] = "1"
    command = [spy, "record", "--subprocesses", "--nonblocking", "-r", str(rate), "-f", "raw", "-o", str(path)]
    subprocess.run([*command, "--", sys.executable, "-m", "pytest", *pytest_args], env=env, check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="run pytest under py-spy")
    rec.add_argument("output", type=Path)
    rec.add_argument("--rate", type=int, default=10, help="samples per second and process (default 10)")
    rec.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: pytest's arguments")
    rep = commands.add_parser("report", help="summarise a recorded profile")
    rep.add_argument("profile", type=Path)
    rep.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    if args.command == "record":
        rest = args.pytest_args
        record(args.output, args.rate, rest[1:] if rest[:1] == ["--"] else rest)
    else:
        report(args.profile, args.top)


if __name__ == "__main__":
    main()
