"""Shell scripts whose Python commands run in the test's own process: the script runs under bash with a recorder as
its ``python`` (first on ``PATH``, and ``$PYTHON``), which writes down each command line instead of running it;
the test then runs the recorded commands in order, in this process (``python -m`` through the same start-up hook),
and so pays no interpreter, torch and JVM start-up for each. A script whose shell lines read what an earlier
Python command of the same script wrote can't be run so."""
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import run_module

RECORDER = """\
import json, os, sys

stdin = sys.stdin.read() if sys.argv[1:2] == ["-"] else None
with open(os.environ["RECORDED_COMMANDS"], "a", encoding="utf-8") as out:
    out.write(json.dumps({"argv": sys.argv[1:], "stdin": stdin}) + "\\n")
"""


def write_recorder(folder: Path) -> Path:
    """The recorder as ``folder/python`` (executable); returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    recorder = folder / "python"
    recorder.write_text(f"#!{sys.executable} -S\n{RECORDER}")
    recorder.chmod(0o755)
    return recorder


def record(args: list[str], recorder: Path, log: Path, env: dict, cwd: Path | None = None) -> list[dict]:
    """Run ``args`` (a bash command line) with ``recorder`` as its ``python``; asserts it exits 0 and returns the
    recorded commands, ``{"argv", "stdin"}`` each, in order."""
    env = {**env, "PYTHON": str(recorder), "RECORDED_COMMANDS": str(log),
           "PATH": f"{recorder.parent}{os.pathsep}{env.get('PATH', os.environ['PATH'])}"}
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()] if log.is_file() else []


def replay(command: dict, name: str) -> None:
    """Run one recorded command (``-m MODULE ARGS``, or ``-`` with the script on its standard input) in this
    process; asserts it exits 0."""
    argv = command["argv"]
    if argv[0] == "-m":
        assert run_module(argv[1], *argv[2:]) == 0, (name, argv)
        return
    assert argv[0] == "-" and command["stdin"], (name, argv)
    saved, sys.argv = sys.argv, argv
    try:
        exec(compile(command["stdin"], f"{name} (standard input)", "exec"), {"__name__": "__main__"})
    finally:
        sys.argv = saved
